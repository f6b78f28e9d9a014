"""i2b2 2010 concept extraction: format, BIO tags, scoring, model adapter."""
