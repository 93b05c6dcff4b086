"""Mode speculate: tokens ordered, on the device, to the rank predicted to hold their experts."""
