"""Text handling shared by the tasks: a checkpoint's tokenizer (``tokenizer.py``) and its chat templates, found and
rendered as transformers does (``chat_template.py``)."""
