"""Cost models the chapters compare with measurements from the real engine."""
