"""HuggingFace ``transformers`` models as users bring them: where a config comes from, the model
built from it, and its loss."""
