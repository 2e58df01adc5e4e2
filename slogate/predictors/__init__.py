"""Estimates for the decision core: output-length upper bounds and workflow stage shares."""
