"""Who may spend what: virtual keys, failed-auth limits, rate limits, budgets, prices and token counting."""
