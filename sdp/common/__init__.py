"""Framework-free pieces shared by every layer: topology, reduce ops, errors, configuration."""
