"""HTML report assembled from per-capability sections (``make demo`` writes it)."""
