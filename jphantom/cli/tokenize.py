"""``jphantom tokenize``: text files in, one token file out (llm.c's or nanoGPT's format) that
``train --data`` reads."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from jphantom.data.tokens import FORMATS

    tokenize = sub.add_parser(
        "tokenize", help="turn text files into a token file that `train --data` reads",
        description="Read text files (and every file matching --pattern in the folders given), "
                    "turn them into token ids with --tokenizer and write one flat token file: "
                    "llm.c's format (a 256-int32 header, then uint16 tokens, or uint32 for "
                    "vocabularies over 65,536 ids) or nanoGPT's (uint16 tokens, no header). Each "
                    "file is a document, preceded by the tokenizer's end-of-text token when it "
                    "has one. Then train on it: jphantom train --data FILE.bin --vocab V, with V "
                    "at least the tokenizer's size (printed at the end). Nothing is downloaded: "
                    "the tokenizer must be on this machine.",
        epilog="Examples: jphantom tokenize notes.txt --out data/train.bin  (the bundled BPE) | "
               "jphantom tokenize corpus/ --pattern '*.md' --tokenizer gpt2/tokenizer.json "
               "--out data/train.bin | jphantom tokenize held_out/ --out data/val.bin  (a file "
               "whose name holds the word val, valid, validation, dev or eval is the validation "
               "split of `train --data data/`; "
               "without one, train holds out the last 5% of the tokens)")
    tokenize.add_argument("inputs", nargs="+", metavar="INPUT",
                          help="text files, or folders searched recursively for --pattern")
    tokenize.add_argument("--out", required=True, metavar="FILE.bin",
                          help="the token file to write (its folder is created)")
    tokenize.add_argument("--tokenizer", default="bpe",
                          help="bpe (the bundled byte-level BPE, 1024 ids), a Hugging Face "
                               "tokenizer.json or its folder, a .tiktoken file, a tiktoken "
                               "encoding name in tiktoken's cache, or bytes (default bpe)")
    tokenize.add_argument("--pattern", default="*.txt",
                          help="which files of a folder to read, a glob (default *.txt)")
    tokenize.add_argument("--format", choices=FORMATS, default="llm.c",
                          help="llm.c: a header that records the token type and count; "
                               "nanogpt: bare uint16 tokens (default llm.c)")
    tokenize.add_argument("--no-eot", dest="eot", action="store_false",
                          help="do not put the end-of-text token before each file")
    tokenize.add_argument("--no-progress", dest="progress", action="store_false",
                          help="no progress bar")
    tokenize.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """``jphantom tokenize``: text in, one token file out (:func:`jphantom.data.tokens.
    tokenize_files`)."""
    from jphantom.data.tokens import tokenize_files

    done = tokenize_files(args.inputs, args.out, args.tokenizer, pattern=args.pattern,
                          format=args.format, eot=args.eot, progress=args.progress)
    print(f"wrote {done['path']}: {done['tokens']:,} tokens ({done['dtype']}, {done['format']}) "
          f"from {done['files']} file(s), {done['bytes']:,} bytes; tokenizer {done['tokenizer']} "
          f"has {done['vocab_size']} ids: train with --data {done['path']} --vocab "
          f"{done['vocab_size']}" + (f" --tokenizer {done['tokenizer']}"
                                     if done["tokenizer"] != "bytes" else ""))
    return 0
