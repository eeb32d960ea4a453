"""An example Sonar plugin that adds a sampler stage: ``example_boost``."""
