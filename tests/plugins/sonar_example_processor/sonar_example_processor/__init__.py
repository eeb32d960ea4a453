"""An example Sonar plugin that adds a sampler: ``no_immediate_repeat``."""
