"""A fake accelerator platform for Sonar's plugin-discovery tests."""
