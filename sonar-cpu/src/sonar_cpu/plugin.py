from sonar.hookspecs import hookimpl
