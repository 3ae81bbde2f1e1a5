"""The engine API, without ROS: text and vision-language models, tokenizer, chat template,
preprocessing, prefix cache, model files, operator tables, latency stages (see README.md)."""
