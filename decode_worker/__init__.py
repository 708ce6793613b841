"""The decode pool's Ray actor: decodes (and prefills locally on the colocated path)."""
