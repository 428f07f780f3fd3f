"""Workers (one per rank) and the model runner they drive."""
