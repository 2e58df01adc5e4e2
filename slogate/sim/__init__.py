"""Discrete-event cluster simulator driving the same decision core as the gateway."""
