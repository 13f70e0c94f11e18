"""Makes tests/ importable for its helper modules (mpijobs.py)."""
