"""The trainer's data: the token store, the offline corpus, cuts and the batch pipeline."""
