"""Chat-level pieces shared by the chat app (`app/`) and the evaluation tools (`eagle/evaluation/`).

- `eagle.chat.templates`: prompts in a model's chat format (conversation -> text -> token ids);
- `eagle.chat.model_types`: the model types (base + head + template) and loading them with clear messages.

This package sits above the engine: `eagle.model` and the layers below it never import it.
"""
