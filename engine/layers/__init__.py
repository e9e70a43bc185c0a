"""Building blocks of the decoder: norms, rotary embeddings, paged attention."""
