"""Whole requests routed to the data-parallel engine their experts live on."""
