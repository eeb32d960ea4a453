"""An example Sonar plugin: the ``shortest-first`` scheduling policy."""
