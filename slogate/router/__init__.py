"""slogate's pure decision core: no I/O, no asyncio, no wall clock."""
