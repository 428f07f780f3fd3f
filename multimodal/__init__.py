"""Multimodal inputs: images in prompts (vision-language models such as LLaVA).

    media.py        load_image(url): data:, http(s): and file: URLs -> PIL images
    processing.py   MultiModalProcessor: placeholder expansion, image preprocessing, content hashes
"""
