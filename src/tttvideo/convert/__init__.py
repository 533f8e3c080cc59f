"""Importers of other systems' trained checkpoints into our run folders (`tttv convert`)."""
