#!/usr/bin/env python3
"""Generates unicode_tables.inc, the Unicode data the WordPiece tokenizer needs.

    .venv/bin/python libtrain/src/text/gen_unicode_tables.py > libtrain/src/text/unicode_tables.inc

Run at development time only; the output is committed (the version of `tokenizers` it came from
is recorded in its first line). Every table is read off Hugging Face's `tokenizers` itself, one
code point at a time, not off a Unicode database: the tokenizer promises tokenizers' ids, and
tokenizers takes its character data from several Rust crates, each frozen at its own, older
Unicode version (categories from `unicode_categories`, NFD from
`unicode-normalization-alignments`, lower case from Rust's standard library). Python's
`unicodedata` follows yet another version, and tables taken from it gave other ids on 503 code
points (marks and punctuation assigned since, which tokenizers treats as letters).

Three tables, each from the tokenizers component that uses it:

  kCategoryRanges  [first, last, class] runs of code points whose class is not "none":
                   1 = dropped by BertNormalizer's clean_text (control, format and private-use
                       characters, NUL and U+FFFD; unassigned code points are kept);
                   2 = non-spacing mark: removed after NFD when BertNormalizer strips accents;
                   3 = punctuation: BertPreTokenizer makes it a word of its own.
  kDecompositions  code point -> NFD of that code point alone (tokenizers' NFD normalizer),
                   except Hangul syllables, which wordpiece.cpp decomposes by the algorithm
  kLowercase       code point -> tokenizers' Lowercase normalizer on that code point alone (one
                   code point at a time, so U+0130 gives two and no final-sigma rule applies)

Whitespace and the CJK ranges are short fixed lists in wordpiece.cpp; tests/python/
tokenizer_oracle.py compares them, with these tables, on every code point.
"""
import sys

from tokenizers import __version__ as tokenizers_version
from tokenizers import normalizers, pre_tokenizers

MAX = 0x110000
NONE, DROPPED, NONSPACING_MARK, PUNCTUATION = 0, 1, 2, 3

# Each probe switches on a single BertNormalizer step, so that its output shows what that one
# step does to a code point.
CLEAN = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=False, strip_accents=False,
                                   lowercase=False)
STRIP = normalizers.BertNormalizer(clean_text=False, handle_chinese_chars=False, strip_accents=True,
                                   lowercase=False)
NFD = normalizers.NFD()
LOWER = normalizers.Lowercase()
PRE = pre_tokenizers.BertPreTokenizer()


def code_points():
    # Surrogates cannot be passed to tokenizers (they are not Unicode scalar values), and UTF-8
    # decoding in wordpiece.cpp never produces one.
    return (cp for cp in range(MAX) if not 0xD800 <= cp <= 0xDFFF)


def hangul_nfd(cp):
    """Unicode section 3.12's decomposition of a Hangul syllable, as wordpiece.cpp computes it."""
    s = cp - 0xAC00
    out = [0x1100 + s // 588, 0x1161 + (s % 588) // 28]
    if s % 28:
        out.append(0x11A7 + s % 28)
    return "".join(map(chr, out))


def probe():
    classes = {}
    decompositions = {}
    lowercase = {}
    for cp in code_points():
        ch = chr(cp)
        found = []
        cleaned = CLEAN.normalize_str(ch)
        if cleaned == "":
            found.append(DROPPED)
        elif cleaned != ch and cleaned != " ":  # whitespace becomes a space, anything else stays
            sys.exit("gen_unicode_tables: clean_text turned U+%04X into %r" % (cp, cleaned))
        if PRE.pre_tokenize_str("a" + ch + "b") == [("a", (0, 1)), (ch, (1, 2)), ("b", (2, 3))]:
            found.append(PUNCTUATION)
        decomposed = NFD.normalize_str(ch)
        if decomposed != ch:
            decompositions[cp] = decomposed
        elif STRIP.normalize_str(ch) == "":
            # Only code points that NFD leaves alone can reach the mark filter, so only their
            # class is observable (and only theirs is asked for).
            found.append(NONSPACING_MARK)
        lowered = LOWER.normalize_str(ch)
        if lowered != ch:
            lowercase[cp] = lowered
        # One class per code point is all the C++ table can hold.
        if len(found) > 1:
            sys.exit("gen_unicode_tables: U+%04X is in classes %s at once" % (cp, found))
        classes[cp] = found[0] if found else NONE

    for cp, decomposed in decompositions.items():
        # Accent stripping filters the decomposition by the class of each of its code points,
        # which is known only when each decomposes to itself; the result must then be what
        # tokenizers' own NFD + filter gives.
        for part in decomposed:
            if ord(part) in decompositions:
                sys.exit("gen_unicode_tables: NFD of U+%04X contains U+%04X, which decomposes further"
                         % (cp, ord(part)))
        kept = "".join(part for part in decomposed if classes[ord(part)] != NONSPACING_MARK)
        if STRIP.normalize_str(chr(cp)) != kept:
            sys.exit("gen_unicode_tables: stripping accents from U+%04X gives %r, the tables %r"
                     % (cp, STRIP.normalize_str(chr(cp)), kept))
        if 0xAC00 <= cp <= 0xD7A3 and decomposed != hangul_nfd(cp):
            sys.exit("gen_unicode_tables: tokenizers decomposes Hangul U+%04X to %r, not by the algorithm"
                     % (cp, decomposed))
    return classes, decompositions, lowercase


def main():
    classes, decompositions, lowercase = probe()
    out = sys.stdout
    out.write("// Generated by gen_unicode_tables.py from Hugging Face tokenizers %s (BertNormalizer,\n"
              "// BertPreTokenizer, NFD and Lowercase probed one code point at a time).\n" % tokenizers_version)
    out.write("// Do not edit; regenerate with the script.\n")
    out.write("// NOLINTBEGIN\n")

    runs = []
    start, current = 0, classes[0]
    for cp in range(1, MAX):
        k = classes.get(cp, NONE)  # surrogates: none
        if k != current:
            runs.append((start, cp - 1, current))
            start, current = cp, k
    runs.append((start, MAX - 1, current))
    runs = [r for r in runs if r[2] != NONE]
    out.write("constexpr CategoryRange kCategoryRanges[] = {\n")
    for a, b, k in runs:
        out.write("    {0x%X, 0x%X, %d},\n" % (a, b, k))
    out.write("};\n\n")

    # Decompositions and lower-case mappings share one pool of code points:
    # {code point, offset into the pool, length}.
    pool = []

    def mapping_table(name, mapping):
        out.write("constexpr Mapping %s[] = {\n" % name)
        for cp in sorted(mapping):
            out.write("    {0x%X, %d, %d},\n" % (cp, len(pool), len(mapping[cp])))
            pool.extend(ord(c) for c in mapping[cp])
        out.write("};\n\n")

    mapping_table("kDecompositions", {cp: d for cp, d in decompositions.items() if not 0xAC00 <= cp <= 0xD7A3})
    mapping_table("kLowercase", lowercase)
    out.write("constexpr char32_t kMappingPool[] = {\n")
    for i in range(0, len(pool), 12):
        out.write("    " + ", ".join("0x%X" % c for c in pool[i:i + 12]) + ",\n")
    out.write("};\n")
    out.write("// NOLINTEND\n")
    print("gen_unicode_tables: tokenizers %s: %d class runs, %d decompositions, %d lower-case mappings"
          % (tokenizers_version, len(runs), len(decompositions), len(lowercase)), file=sys.stderr)


if __name__ == "__main__":
    main()
