"""Framework adapters. Each translates framework objects to the engine's items and back; none does I/O."""
