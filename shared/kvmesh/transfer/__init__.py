"""Moving KV blocks between workers' pools (the Mooncake transfer engine)."""
