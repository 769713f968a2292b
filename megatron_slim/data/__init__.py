"""Training text for tiny real runs, before Megatron's format: a real corpus, a Hugging Face
tokenizer, a build-once cache. Imports no megatron and no torch.

    corpus.py       list_corpus("stdlib" | dir): sorted UTF-8 text files + content fingerprint
    tokenizer.py    train_tokenizer: tokenizers' byte-level BPE trained on ~2 MB spread over the corpus
    cache.py        default_cache_dir, build_once: one builder per cache entry, the rest wait and reuse

Writing the tokens in megatron-core's indexed format, caching the prepared corpus and drawing
``GPTDataset`` samples from it need megatron-core: ``megatron_slim.megatron.data``.
"""

from megatron_slim.data.cache import default_cache_dir
from megatron_slim.data.corpus import Corpus, Document, list_corpus, stdlib_root
from megatron_slim.data.tokenizer import CorpusTokenizer, train_tokenizer

__all__ = [
    "Corpus",
    "CorpusTokenizer",
    "Document",
    "default_cache_dir",
    "list_corpus",
    "stdlib_root",
    "train_tokenizer",
]
