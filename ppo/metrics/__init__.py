"""Measurement: stage timers, FLOP accounting, profiles, the garbage collector's pauses, the sample log."""
