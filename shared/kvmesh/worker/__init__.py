"""What every worker service shares: settings, the engine host, registration, load, drain."""
