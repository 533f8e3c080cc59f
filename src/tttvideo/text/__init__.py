"""The text side: scene tokens and prompts (prompts), T5 (t5), the demo's captions and text encoder (demo), and the
choice between them for sampling (encoders)."""
