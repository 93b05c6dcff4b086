"""A placement applied: expert weights renamed to slots at load, checked, swapped live."""
