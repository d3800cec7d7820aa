"""Personas as data: the registry (seeded from config, cached), their commands, guidelines and rules."""
