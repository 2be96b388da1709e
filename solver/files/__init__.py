"""Reading and writing the user's files: JSON input, plan documents, cluster files, outputs."""
