"""BertForMaskedLM's names of BertPipeline's parameters (model/pipeline.py), for whoever reads a
pipeline's weights: the export and the tests. Apart from pipeline.py so that the export loads
where DeepSpeed cannot be imported."""

from typing import Optional, Sequence

WORD_EMBEDDINGS, POSITIONAL = "word_embeddings", "positional"  # BertPipeline's tied keys
# Its tied modules' parameters ("key.attribute....") -> BertForMaskedLM's names.
TIED_NAMES = (
    (f"{WORD_EMBEDDINGS}.embedding.", "embedding."),
    (f"{WORD_EMBEDDINGS}.final_layernorm.", "encoder.block.final_layernorm."),
    (f"{WORD_EMBEDDINGS}.lm_head.", "lm_head."),
    (f"{POSITIONAL}.positional.", "encoder.positional."),
)
WORD_EMBEDDING_COPY = f"{WORD_EMBEDDINGS}.word_embeddings.weight"  # the last stage's, for the head


def bert_name(name: str, layer_indices: Sequence[int] = (), copies: bool = True) -> Optional[str]:
    """BertForMaskedLM's name of a BertPipeline parameter, named as the pipeline module names it
    ("tied_modules.word_embeddings.lm_head.dense.weight", "12.layer.mlp.linear_fc1.weight") or
    as its tied module does ("word_embeddings.lm_head.dense.weight"). layer_indices: the pipeline
    indices of the transformer layers, in order. The last stage's copy of the word embedding is
    the embedding's own name, or None with copies=False."""
    name = name.removeprefix("tied_modules.")
    if name == WORD_EMBEDDING_COPY:
        return "embedding.word_embeddings.weight" if copies else None
    for prefix, replacement in TIED_NAMES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    index, rest = name.split(".", 1)  # a TransformerLayerPipe: "12.layer.self_attention...."
    return f"encoder.block.layers.{layer_indices.index(int(index))}.{rest.removeprefix('layer.')}"
