"""A model's files: what reads and writes them, beside the model they describe.

``hf`` (Hugging Face ``config.json`` and safetensors, the name and layout mapping),
``gguf`` (GGUF files, dequantised), ``tokenizer`` (``HFTokenizer`` from ``tokenizer.json``
or a GGUF vocabulary), ``chat_template`` (the checkpoint's Jinja chat template) and
``pretrained`` (``from_pretrained`` / ``save_pretrained``, which put them together).
"""
