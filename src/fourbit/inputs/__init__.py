"""What a study starts from: the corpus, the model's source (and the builtin model
and tokenizer the workflow trains), and what the installed tools can read."""
