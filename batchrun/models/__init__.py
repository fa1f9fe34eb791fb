"""Model definitions, configs and weight loaders."""
