"""What a run shows and writes while it trains: progress bar and metrics."""
