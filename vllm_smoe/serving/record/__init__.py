"""Routing recorded from live serving, in any mode and layout, and written as traces."""
