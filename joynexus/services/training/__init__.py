"""Training Model Service (paper 4.2): the resident backbone and every tenant's training slot."""
