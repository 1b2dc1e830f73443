"""Data: tokenizers, document packing, sources (local corpus / JSONL / TXT / hub), parquet shards,
Ray Data datasets. Importing this package imports neither ray nor pyarrow."""
from nsa.data.packing import pack_documents, tokenize_and_pack
from nsa.data.tokenizers import ByteTokenizer, Tokenizer, get_tokenizer

__all__ = ["ByteTokenizer", "Tokenizer", "get_tokenizer", "pack_documents", "tokenize_and_pack"]
