#!/usr/bin/env python3
"""Generate the tokenizer fixtures for ditserve's C tokenizers
(worker/encoders/clip_tokenizer.c and worker/encoders/t5_tokenizer.c).

Run from anywhere (paths default to this repository's tests/data):

    python3 tests/text/gen_tokenizer_fixtures.py [--out tests/data/tokenizers]

Needs transformers, tokenizers and sentencepiece (CPU; a run takes seconds).
`ftfy` must NOT be installed: transformers 4.x's slow CLIPTokenizer changes
its text cleanup when ftfy is importable, so the script refuses to run with
it (transformers 5, whose CLIPTokenizer is backed by `tokenizers`, ignores
ftfy; the refusal keeps the fixtures reproducible under either).

What it writes
--------------
<out>/clip/   A small CLIP tokenizer in exactly the layout of FluxPipeline's
              `tokenizer/` folder: vocab.json, merges.txt,
              tokenizer_config.json, special_tokens_map.json (no
              tokenizer.json, as in the FLUX.1 repositories). The byte-level
              BPE is trained here on TRAIN_TEXT the way CLIP's vocabulary was
              built: the 256 byte symbols, their "</w>" (end of word) forms,
              one entry per learned merge, then <|startoftext|> and
              <|endoftext|>. It is loaded back with transformers'
              CLIPTokenizer to prove the format.
<out>/t5/     A small T5 tokenizer in the layout of FluxPipeline's
              `tokenizer_2/` folder: spiece.model (a SentencePiece unigram
              model trained on TRAIN_TEXT with the default nmt_nfkc
              normalization and T5's special ids: <pad>=0, </s>=1, <unk>=2,
              no <s>), and the tokenizer.json, tokenizer_config.json and
              special_tokens_map.json that T5TokenizerFast.save_pretrained
              writes for it (a Precompiled normalizer holding the nmt_nfkc
              charsmap, WhitespaceSplit + Metaspace, Unigram, 100
              <extra_id_N> sentinels).
<out>/cases.json
              {"strings": [every test string],
               "clip": {"dir", "max_lengths", "pad_id", "cases"},
               "t5":   {"dir", "max_lengths", "pad_id", "cases"},
               "clip_variants": [...], "t5_variants": [...]}
              A case is {"s": index into strings, "<L>": ids, ..., "cut": [L...]}:
              for every L in max_lengths the ids of
                  tok(text, padding="max_length", max_length=L,
                      truncation=True).input_ids
              up to the first padding position (the rest is pad_id; the
              generator checks that), and in "cut" (omitted when empty) the
              lengths at which truncation dropped tokens. The tokenizers are
              the ones loaded back from <out>/clip and <out>/t5 with
              CLIPTokenizer and T5TokenizerFast (what FluxPipeline uses).
              clip_variants: other tokenizer_config.json /
              special_tokens_map.json contents (null: file absent) for the
              same vocabulary, expected ids from CLIPTokenizer; one with
              "layout": "tokenizer.json" stands for transformers 5's
              save_pretrained output (tokenizer.json holding vocab.json,
              merges.txt as pairs and "added_tokens").
              t5_variants: other normalizer / pre_tokenizer pipelines
              spliced into a copy of t5/tokenizer.json ("@charsmap" stands
              for its precompiled_charsmap); expected ids from the
              `tokenizers` library itself, since transformers 5's
              T5TokenizerFast rebuilds its own pipeline (transformers 4
              used the file's as is). Variant cases: {"s", "ids", "cut"}
              at the variant's one max_length.
"""

import argparse
import collections
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import unicodedata

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.normpath(os.path.join(HERE, "..", "data", "tokenizers"))

CLIP_MAX_LENGTHS = [77, 16]
T5_MAX_LENGTHS = [512, 64, 8]
CLIP_MERGES = 1200
T5_VOCAB = 1000

# Training text: image prompts in English plus a little of many scripts, so
# that both vocabularies hold multi-byte pieces and the test strings hit
# known pieces, unknown characters and byte fallbacks alike.
TRAIN_TEXT = """\
A photograph of an astronaut riding a horse on the moon, highly detailed, 8k.
A cat sitting on a wooden table next to a cup of coffee, soft morning light.
Portrait of an old fisherman with a grey beard, oil painting, dramatic lighting.
A futuristic city skyline at night with neon lights and flying cars.
A bowl of fresh fruit: apples, oranges, bananas and grapes on a marble counter.
Watercolor illustration of a small red fox sleeping under a pine tree in the snow.
An isometric render of a cozy bedroom with plants, books and a warm lamp.
Close-up macro shot of a dew drop on a green leaf, shallow depth of field.
The quick brown fox jumps over the lazy dog. The lazy dog doesn't care.
It's a beautiful day, isn't it? We're going to the beach and they'll come too.
I'm sure you've seen it; he'd said that she'd be late, but we'd already left.
Don't stop believing! Can't stop, won't stop. Shouldn't we try again?
A steampunk airship flying over Victorian London, brass gears, volumetric fog.
Minimalist logo of a mountain and the sun, flat design, vector art, white background.
A hyperrealistic painting of a tiger drinking water from a river in the jungle.
Cinematic still of a lone samurai standing in a field of red flowers at sunset.
A knight in shining armor fighting a dragon, epic fantasy art, trending on artstation.
Children playing football in the street after the rain, reflections in the puddles.
A bright yellow submarine deep under the ocean surrounded by jellyfish and coral.
Street photography in Tokyo at night, rain, umbrellas, glowing signs, 35mm film.
A vintage car parked in front of a diner in the 1950s, kodachrome colors.
A delicious chocolate cake with strawberries and whipped cream on a white plate.
Ancient ruins overgrown with vines in a misty forest, god rays, matte painting.
A robot painting a self-portrait in a sunlit studio, impressionist style.
Prices: $19.99, 25% off, 3.14159, 1,000,000 people, 2024-06-01 at 10:30pm.
Phone +1 (555) 123-4567, room 42B, order #1337, version v2.0.1, 4K UHD 60fps.
Visit https://example.com/path?query=value&lang=en or mail info@example.org now.
Use the C function printf("%d\\n", x); and the shell command ls -la /usr/bin | grep py.
Le café est délicieux, mais la crème brûlée était encore meilleure à Paris.
Où est la bibliothèque ? Je ne sais pas, demandez à l'élève près de la fenêtre.
Les enfants jouent dans le jardin pendant que leurs parents préparent le dîner.
Ein schönes Mädchen läuft über die Straße und grüßt den älteren Herrn höflich.
Die Größe der Bäume im Wald überrascht jeden Besucher im Frühling und Sommer.
El niño pequeño comió una manzana roja en el jardín de su abuela en España.
¿Dónde está la estación de tren? ¡Qué día tan bonito hace hoy en la montaña!
A canção do pássaro na manhã de verão é linda, disse a avó ao neto em Lisboa.
Η γρήγορη καφέ αλεπού πηδάει πάνω από το τεμπέλικο σκυλί στην Αθήνα.
Быстрая коричневая лиса прыгает через ленивую собаку в Москве зимой.
Привет, как дела? Сегодня хорошая погода, пойдём гулять в парк вечером.
東京の夜景はとても美しいです。富士山の写真を撮りました。
猫がテーブルの上で寝ています。今日は天気がいいですね。
我喜欢在公园里散步，看着孩子们玩耍。这是一幅美丽的山水画。
北京是中国的首都，长城是世界上最著名的建筑之一。
서울의 밤거리는 정말 아름답습니다. 오늘 날씨가 좋네요.
العربية لغة جميلة، وهذه صورة لقطة تجلس على الطاولة.
नमस्ते, आप कैसे हैं? यह एक सुंदर चित्र है।
שלום עולם, זו תמונה של חתול ישן על הספה.
Türkçe öğrenmek çok güzel, İstanbul'da çay içtik ve ğüşiöç harflerini yazdık.
Zażółć gęślą jaźń, powiedział Łukasz w Kraków podczas śniadania.
Příliš žluťoučký kůň úpěl ďábelské ódy v Praze.
Tiếng Việt có nhiều dấu: trường học, người Việt Nam, phở bò ngon lắm.
Ｆｕｌｌｗｉｄｔｈ ｌｅｔｔｅｒｓ ａｎｄ ｄｉｇｉｔｓ １２３ look different.
The ﬁrst ﬂoor oﬃce has a ﬁne view; ligatures like ﬀ and ﬄ appear in old books.
Emoji: 😀 😂 ❤️ 👍 🎉 🔥 🌈 🐱 🐶 🍕 ☕ 🚀 ⭐ 🌙 ✨
Families 👨‍👩‍👧‍👦 and skin tones 👍🏻 👍🏿 👋🏽, flags 🇫🇷 🇯🇵 🇺🇸.
Mathematical symbols: ∑ ∫ √ π ≈ ≠ ≤ ≥ ∞ ± × ÷ → ← ↑ ↓ ° µ Ω.
Quotes “double” and ‘single’, dashes – and —, ellipsis… and bullets • here.
Roman numerals Ⅻ and Ⅳ, circled ① ② ③, superscripts x² y³ and fractions ½ ¼.
A photo of a golden retriever puppy playing in autumn leaves, bokeh background.
Landscape with snowy mountains reflected in a calm lake, sunrise, pastel colors.
A cyberpunk girl with pink hair and glowing tattoos, digital art, 4k wallpaper.
Interior design of a modern kitchen with wooden cabinets and a large window.
Aerial view of a tropical island with white sand beaches and turquoise water.
Good food, cool pool, a full moon, look at the book, see the green tree, feel free.
Three sheep sleep soon; all balls fall, too; coffee and toffee; the bee sees the seed.
Hello yellow balloon, a small tall mall, the wooden spoon, the room looks good and cool.
A cute baby elephant wearing a tiny hat, children's book illustration.
"""

# Repeated with small variations so that the unigram trainer sees each
# sentence often enough to keep multi-character pieces.
TRAIN_REPEAT = 6


def training_lines():
    base = [ln for ln in TRAIN_TEXT.splitlines() if ln.strip()]
    lines = []
    for r in range(TRAIN_REPEAT):
        for i, ln in enumerate(base):
            if r % 3 == 1:
                ln = ln.lower()
            elif r % 3 == 2 and i % 2 == 0:
                ln = ln.upper()
            lines.append(ln)
    return lines


# ---- CLIP ----------------------------------------------------------------


def bytes_to_unicode():
    """GPT-2/CLIP's reversible map from bytes to printable characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def clip_pre_tokenize(lines):
    """Words (byte-level strings) of `lines` as CLIPTokenizer splits them:
    the same normalizer and pre-tokenizer transformers 5 builds in
    models/clip/tokenization_clip.py."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    norm = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(
                    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
                ),
                behavior="removed",
                invert=True,
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    words = collections.Counter()
    for ln in lines:
        for w, _ in pre.pre_tokenize_str(norm.normalize_str(ln)):
            words[w] += 1
    return words


def learn_bpe(words, n_merges):
    """Classic BPE learning with CLIP's end-of-word marker: a word is its
    characters with "</w>" glued to the last one; each step merges the most
    frequent adjacent pair (ties: the smallest pair, for determinism)."""
    seqs = {w: tuple(w[:-1]) + (w[-1] + "</w>",) for w in words}
    merges = []
    for _ in range(n_merges):
        pairs = collections.Counter()
        for w, sym in seqs.items():
            for a, b in zip(sym, sym[1:]):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if best[1] < 2:
            break
        a, b = best[0]
        merges.append((a, b))
        for w, sym in seqs.items():
            out, i = [], 0
            while i < len(sym):
                if i + 1 < len(sym) and sym[i] == a and sym[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(sym[i])
                    i += 1
            seqs[w] = tuple(out)
    return merges


def write_clip(out_dir):
    byte_syms = list(bytes_to_unicode().values())
    merges = learn_bpe(clip_pre_tokenize(training_lines()), CLIP_MERGES)
    vocab_list = byte_syms + [s + "</w>" for s in byte_syms]
    seen = set(vocab_list)
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            vocab_list.append(a + b)
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {tok: i for i, tok in enumerate(vocab_list)}
    bos, eos = len(vocab_list) - 2, len(vocab_list) - 1

    os.makedirs(out_dir, exist_ok=True)
    # The FLUX.1 / openai CLIP files: vocab.json sorted by key, merges.txt
    # with its "#version" header line.
    with open(os.path.join(out_dir, "vocab.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(vocab, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for a, b in merges:
            f.write(f"{a} {b}\n")

    def tok(content, normalized, special=True):
        return {
            "content": content,
            "lstrip": False,
            "normalized": normalized,
            "rstrip": False,
            "single_word": False,
            **({"special": True} if special else {}),
        }

    # Copies of black-forest-labs/FLUX.1-dev's tokenizer/ configs (the
    # openai/clip-vit-large-patch14 ones), with this vocabulary's ids.
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(bos): tok("<|startoftext|>", True),
            str(eos): tok("<|endoftext|>", False),
        },
        "bos_token": "<|startoftext|>",
        "clean_up_tokenization_spaces": True,
        "do_lower_case": True,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 77,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "CLIPTokenizer",
        "unk_token": "<|endoftext|>",
    }
    special_map = {
        "bos_token": tok("<|startoftext|>", True, special=False),
        "eos_token": tok("<|endoftext|>", True, special=False),
        "pad_token": "<|endoftext|>",
        "unk_token": tok("<|endoftext|>", True, special=False),
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(config, indent=2) + "\n")
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(special_map, indent=2) + "\n")
    return len(vocab), len(merges)


# ---- T5 ------------------------------------------------------------------


def write_t5(out_dir):
    import sentencepiece as spm
    from transformers import T5TokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w", encoding="utf-8") as f:
            f.write("\n".join(training_lines()) + "\n")
        prefix = os.path.join(tmp, "spiece")
        # T5's special ids; nmt_nfkc is SentencePiece's default rule set (the
        # one t5-v1_1-xxl's spiece.model carries). character_coverage < 1
        # leaves the rarest characters out of the vocabulary, so they become
        # <unk> the way they do in the real model.
        spm.SentencePieceTrainer.train(
            input=corpus,
            model_prefix=prefix,
            model_type="unigram",
            vocab_size=T5_VOCAB,
            normalization_rule_name="nmt_nfkc",
            character_coverage=0.995,
            pad_id=0,
            eos_id=1,
            unk_id=2,
            bos_id=-1,
            pad_piece="<pad>",
            eos_piece="</s>",
            unk_piece="<unk>",
            num_threads=1,
            seed_sentencepiece_size=100000,
            shuffle_input_sentence=False,
            minloglevel=2,
        )
        # The trainer records its (temporary) paths in the model; make them
        # stable so that the fixture is reproducible byte for byte.
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()
        with open(prefix + ".model", "rb") as f:
            proto.ParseFromString(f.read())
        del proto.trainer_spec.input[:]
        proto.trainer_spec.input.append("corpus.txt")
        proto.trainer_spec.model_prefix = "spiece"
        with open(prefix + ".model", "wb") as f:
            f.write(proto.SerializeToString())
        # from_pretrained on a folder holding only spiece.model runs
        # transformers' SentencePiece -> tokenizers conversion (constructing
        # T5TokenizerFast(vocab_file=...) directly would not).
        src = os.path.join(tmp, "src")
        os.makedirs(src)
        shutil.copyfile(prefix + ".model", os.path.join(src, "spiece.model"))
        tok = T5TokenizerFast.from_pretrained(src, model_max_length=512, legacy=True)
        os.makedirs(out_dir, exist_ok=True)
        tok.save_pretrained(out_dir)
        shutil.copyfile(prefix + ".model", os.path.join(out_dir, "spiece.model"))
    return len(tok)


# ---- test strings ----------------------------------------------------------

LONG_PROMPT = (
    "A breathtaking ultra-detailed matte painting of an ancient floating city above the clouds at "
    "golden hour, with waterfalls pouring off marble terraces, hanging gardens full of exotic "
    "flowers, airships docking at crystal towers, flocks of white birds, warm volumetric light, "
    "soft haze, intricate architecture inspired by Art Nouveau and Gothic cathedrals, painted by "
    "a master of romanticism, trending on ArtStation, 8k resolution, octane render, cinematic "
    "composition, wide angle lens, dramatic sky, rich colors, sharp focus, masterpiece. "
)


def test_strings():
    """At least 200 strings covering what prompts contain."""
    s = [
        # empty / whitespace
        "", " ", "  ", "\t", "\n", "\r\n", " \t\n ", "\u00a0", "\u3000", "\u2003\u2009",
        "a\u00a0b", "a\u3000b", "a\u2028b", "a\u0085b", "a\u200bb", "a\ufeffb",
        "   leading spaces", "trailing spaces   ", "multiple     inner      spaces",
        "tabs\tand\nnewlines\r\nmixed", "line one\nline two\n\nline four",
        # ASCII
        "a", "A", "hello", "Hello World", "HELLO WORLD", "a photo of a cat",
        "A photograph of an astronaut riding a horse on the moon.",
        "The quick brown fox jumps over the lazy dog",
        "portrait of a woman, oil painting, highly detailed, 4k",
        "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "supercalifragilisticexpialidocious", "pneumonoultramicroscopicsilicovolcanoconiosis",
        "xqzjvkw", "zzzzzzzzzzzzzzzzzzzzzzzz", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "CamelCaseWordsTogether", "snake_case_identifier", "kebab-case-words",
        # odd runs: which of two equal-rank pairs merges first shows
        "aaa", "aaaaa", "eee", "ooooooo", "sssss", "lllllll", "heeeeeeey", "nooooooo",
        "hmmmmm", "wowwwww", ".....", "!!!!!!!", "zzz",
        "oooo", "ooooo", "oooooo", "eeee", "eeeee", "llll", "lllll", "ssss", "tttttt",
        "bookkeeper", "balloon", "coffee", "committee", "mississippi", "aardvark",
        # punctuation
        "Hello, world!", "What?!?!", "...", "!!!", "???", "---", "___", "***", "''", '""',
        "(parenthesized)", "[brackets] {braces} <angles>", "a/b\\c|d", "~`@#$%^&*()_+-=",
        "end.", "Mr. Smith & Mrs. Jones", "e.g. i.e. etc.", "semi;colon:colon",
        "a-b_c.d,e;f:g!h?i", "<html><body>hi</body></html>", "1+1=2", "x^2 + y^2 = z^2",
        # contractions
        "it's", "It's", "IT'S", "don't", "DON'T", "we're", "they've", "I'm", "you'll", "he'd",
        "it 's", "'s", "'sup", "rock'n'roll", "o'clock", "''s", "!'s", "dogs' toys",
        "I'M SURE YOU'LL BE FINE", "she'd've", "y'all'd've", "it’s curly",
        # accents, NFC and NFD
        "café", "cafe\u0301", "naïve", "nai\u0308ve", "résumé", "re\u0301sume\u0301",
        "Crème Brûlée", "Cre\u0300me Bru\u0302le\u0301e", "Ångström", "A\u030angstro\u0308m",
        "São Paulo", "Sa\u0303o Paulo", "Zoë", "jalapeño", "jalapen\u0303o", "façade",
        "Übermensch", "U\u0308bermensch", "straße", "STRASSE", "Æsir", "œuvre", "Øresund",
        "İstanbul", "i\u0307stanbul", "ıi", "ΣΊΣΥΦΟΣ", "ὈΔΥΣΣΕΎΣ", "Ǆemal", "ǅ", "ﬀ",
        "e\u0301\u0302\u0323", "a\u0308\u0301", "x\u0301", "\u0301", "\u0301\u0301\u0301",
        "Ａ\u0301", "ｅ\u0301", "ﬁ\u0301", "①\u0301",
        # other scripts
        "Привет, мир!", "ПРИВЕТ", "Ёлка", "Е\u0308лка", "Γειά σου Κόσμε", "Αθήνα",
        "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "क्षत्रिय", "สวัสดีชาวโลก", "ภาษาไทย",
        "Xin chào thế giới", "Tiếng Việt", "ሰላም", "გამარჯობა", "Բարեւ", "ꦱꦸꦒꦼꦁ",
        # CJK
        "你好世界", "我喜欢在公园里散步", "東京の夜景", "猫がテーブルの上で寝ています。",
        "ｶﾀｶﾅ", "カタカナ", "ひらがな", "안녕하세요 세계", "서울", "\u1100\u1161\u11a8",
        "漢字かなカナ混じり文", "中文，标点。符号！", "「引用」『二重』【括弧】",
        "𠀀𠀁𪚥", "龘靐齉", "日本語とEnglishの混在テキスト",
        # full-width and compatibility
        "Ｆｕｌｌｗｉｄｔｈ", "ＡＢＣ１２３", "！？＂＃", "１２３４５", "ｈｅｌｌｏ　ｗｏｒｌｄ",
        "ﬁne ﬂower ﬃ ﬄ ﬅ ﬆ", "ﬁ", "Ⅻ Ⅳ ⅷ", "① ② ⑳", "x² y³ z⁴", "H₂O CO₂", "½ ¼ ¾ ⅞",
        "℃ ℉ ㎏ ㎡ ㍿", "™ © ®", "ℌℑℜ", "𝐁𝐨𝐥𝐝 𝑰𝒕𝒂𝒍𝒊𝒄", "ǲ", "Ǳ", "µ", "Ω Ω",
        "…", "‥", "‼", "⁇",
        # emoji
        "😀", "😀😀😀", "I ❤️ NY", "❤", "❤️", "👍", "👍🏻", "👍🏿", "👋🏽 hi", "🇫🇷", "🇯🇵🇺🇸",
        "👨‍👩‍👧‍👦", "👩‍💻", "🏳️‍🌈", "🧑🏾‍🚀", "1️⃣", "#️⃣", "🔥🔥🔥 fire", "cat🐱dog🐶",
        "✨sparkles✨", "☕ coffee", "🚀 to the 🌙", "⭐️⭐️⭐️",
        # numbers
        "0", "42", "123456789", "3.14159", "1,000,000", "-17", "+49", "1e10", "0x1F", "2024-06-01",
        "10:30pm", "$19.99", "25%", "#1", "v2.0.1", "4K UHD 60fps", "٣٤٥", "१२३", "一二三",
        "Ⅳ4", "①1", "12345678901234567890",
        # URLs, code
        "https://example.com/path?query=value&lang=en#frag",
        "http://www.test.org", "mail me at info@example.org", "C:\\Users\\name\\file.txt",
        "printf(\"%d\\n\", x);", "def f(x): return x**2", "SELECT * FROM t WHERE a='b';",
        "#hashtag @mention", "<|startoftext|>", "<|endoftext|>",
        "a<|endoftext|>b", "<|startoftext|>hello<|endoftext|>", "<|ENDOFTEXT|>",
        "<|StartOfText|> x", "x<|endoftext|", "</s>", "hello</s>world", "<pad>", "<unk>",
        "<extra_id_0>", "<extra_id_99> sentinel <extra_id_1>", "<s>", "</w>",
        "a <extra_id_0> b", "a<extra_id_1>b", "a <extra_id_1> b", "NEW ＮＥＷ new", "x</s>",
        # control characters
        "a\x00b"[:1] + "b", "a\x01b", "bell\x07", "esc\x1b[0m", "del\x7f", "c1\x85\x9f",
        "zero\u200bwidth", "bidi\u202etext", "soft\u00adhyphen", "word\u2060joiner",
        # mixed
        "Señor García's café—open 24/7!", "naïve café résumé ÀÉÎÕÜ",
        "Mixed: English, Русский, 中文, العربية, हिन्दी, 😀",
        "A photo of 3 cats & 2 dogs (cute!) — taken in 2023 📸",
        "masterpiece, best quality, ultra-detailed, (photorealistic:1.4), 8k",
        "a cat:0.5 AND a dog:1.5", "[[[emphasis]]] (((more))) {{{even more}}}",
    ]
    # Long prompts: they truncate at 77 (CLIP) and at 64 / 512 (T5).
    s.append(LONG_PROMPT)
    s.append(LONG_PROMPT * 2)
    s.append(LONG_PROMPT * 6)
    s.append("word " * 100)
    s.append("日本語の長い文章です。" * 30)
    s.append("😀" * 80)
    s.append(" ".join(str(i) for i in range(300)))
    s.append("a" * 1000)
    s.append("tiny " * 15 + "end")
    return s


# ---- expected ids ----------------------------------------------------------


def encode_case(tok, text, max_length, pad_id):
    """Ids before padding, and whether truncation dropped tokens."""
    enc = tok(text, padding="max_length", max_length=max_length, truncation=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert len(ids) == max_length, (text, max_length, len(ids))
    n = sum(mask)
    assert all(i == pad_id for i in ids[n:]), (text, ids)
    full = len(tok(text)["input_ids"])
    return ids[:n], full > max_length


def encode_backend(tok, text, max_length, pad_id, pad_token):
    """The same with a bare tokenizers.Tokenizer (for tokenizer.json variants)."""
    tok.enable_truncation(max_length=max_length)
    tok.enable_padding(length=max_length, pad_id=pad_id, pad_token=pad_token)
    enc = tok.encode(text)
    ids, mask = enc.ids, enc.attention_mask
    assert len(ids) == max_length
    n = sum(mask)
    assert all(i == pad_id for i in ids[n:])
    tok.no_truncation()
    tok.no_padding()
    full = len(tok.encode(text).ids)
    return ids[:n], full > max_length


def run_cases(tok, strings, max_lengths, pad_id):
    cases = []
    for k, text in enumerate(strings):
        case, cut = {"s": k}, []
        for L in max_lengths:
            case[str(L)], was_cut = encode_case(tok, text, L, pad_id)
            if was_cut:
                cut.append(L)
        if cut:
            case["cut"] = cut
        cases.append(case)
    return cases


def variant_case(k, ids_cut):
    ids, cut = ids_cut
    return {"s": k, "ids": ids, **({"cut": True} if cut else {})}


# Extra CLIP configurations, same vocab.json / merges.txt. Each replaces
# tokenizer_config.json (null: no file) and special_tokens_map.json.
def clip_variants(base_config, bos, eos):
    def tok(content, normalized, **kw):
        d = {"content": content, "lstrip": False, "normalized": normalized, "rstrip": False,
             "single_word": False, "special": True}
        d.update(kw)
        return d

    no_atd = {k: v for k, v in base_config.items() if k != "added_tokens_decoder"}
    return [
        # stable-diffusion-2 style: pad_token "!" (id of "!") without an
        # added_tokens_decoder entry, so "!" becomes an added token too.
        ("pad_bang", dict(base_config, pad_token="!"), None),
        # Older configs: no added_tokens_decoder; special_tokens_map.json's
        # objects decide the flags (the later plain-string pad_token wins
        # for <|endoftext|>).
        ("legacy_special_map", no_atd, {
            "bos_token": {k: v for k, v in tok("<|startoftext|>", True).items() if k != "special"},
            "eos_token": {k: v for k, v in tok("<|endoftext|>", True).items() if k != "special"},
            "pad_token": "<|endoftext|>",
            "unk_token": {k: v for k, v in tok("<|endoftext|>", True).items() if k != "special"},
        }),
        # Neither file: CLIPTokenizer's defaults, every special token raw.
        ("no_config", None, None),
        # Added-token flags: <|endoftext|> eats the whitespace around it,
        # <|startoftext|> only counts as a whole word.
        ("strip_flags", dict(base_config, added_tokens_decoder={
            str(bos): tok("<|startoftext|>", False, single_word=True),
            str(eos): tok("<|endoftext|>", False, lstrip=True, rstrip=True),
        }), None),
    ]


# tokenizer.json pipelines other than the one transformers 5 writes. The
# C tests splice them into a copy of the committed tokenizer.json;
# "@charsmap" stands for its precompiled_charsmap. KEEP: the committed one.
KEEP = object()


def t5_variants(t5_json):
    pre = {"type": "Precompiled", "precompiled_charsmap": "@charsmap"}
    # added_tokens_decoder with other flags (what FLUX.1's tokenizer_2 config
    # carries, there with the default flags) and a normalized token that is
    # not in the vocabulary.
    atd = {}
    for t in t5_json["added_tokens"]:
        atd[str(t["id"])] = {k: v for k, v in t.items() if k != "id"}
    by_content = {v["content"]: v for v in atd.values()}
    by_content["<extra_id_0>"].update(lstrip=True, rstrip=True)
    by_content["<extra_id_1>"].update(single_word=True)
    by_content["</s>"].update(normalized=True)
    atd[str(len(t5_json["model"]["vocab"]))] = {
        "content": "ＮＥＷ", "single_word": False, "lstrip": False, "rstrip": False,
        "normalized": True, "special": False}
    return [
        # The form FLUX.1's tokenizer_2/tokenizer.json (older transformers)
        # uses: legacy Metaspace(add_prefix_space=true), no prepend_scheme.
        ("legacy_metaspace", pre, {"type": "Sequence", "pretokenizers": [
            {"type": "WhitespaceSplit"},
            {"type": "Metaspace", "replacement": "\u2581", "add_prefix_space": True}]}, None),
        # transformers 4.4x's SpmConverter: no WhitespaceSplit, runs of
        # spaces collapsed by a Replace regex, trailing space stripped.
        ("spm_converter_v4", {"type": "Sequence", "normalizers": [
            pre,
            {"type": "Strip", "strip_left": False, "strip_right": True},
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": "\u2581"}]},
         {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
          "split": True}, None),
        # prepend_scheme "first", no split: whole runs go to the Viterbi.
        ("metaspace_first_nosplit", {"type": "Sequence", "normalizers": [
            pre, {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}]},
         {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
          "split": False}, None),
        # No normalizer at all: full-width letters, ligatures and combining
        # marks reach the model as they are.
        ("no_normalizer", None, {"type": "Sequence", "pretokenizers": [
            {"type": "WhitespaceSplit"},
            {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "never",
             "split": True}]}, None),
        # Same tokenizer.json, tokenizer_config.json with added_tokens_decoder
        # (expected ids from T5TokenizerFast, which reads it).
        ("config_added_tokens", KEEP, KEEP, {"added_tokens_decoder": atd, "eos_token": "</s>",
                                             "pad_token": "<pad>", "unk_token": "<unk>",
                                             "model_max_length": 512,
                                             "tokenizer_class": "T5Tokenizer"}),
    ]


def splice_t5(tokenizer_json, normalizer, pre_tokenizer):
    charsmap = tokenizer_json["normalizer"]["precompiled_charsmap"]

    def sub(x):
        if isinstance(x, dict):
            return {k: sub(v) for k, v in x.items()}
        if isinstance(x, list):
            return [sub(v) for v in x]
        return charsmap if x == "@charsmap" else x

    out = dict(tokenizer_json)
    if normalizer is not KEEP:
        out["normalizer"] = sub(normalizer)
    if pre_tokenizer is not KEEP:
        out["pre_tokenizer"] = sub(pre_tokenizer)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    if importlib.util.find_spec("ftfy") is not None:
        sys.exit("ftfy is installed; uninstall it (pip uninstall -y ftfy): the fixtures describe "
                 "CLIPTokenizer without ftfy")

    import tokenizers
    import transformers
    from tokenizers import Tokenizer
    from transformers import CLIPTokenizer, T5TokenizerFast

    clip_dir = os.path.join(args.out, "clip")
    t5_dir = os.path.join(args.out, "t5")
    for d in (clip_dir, t5_dir):
        shutil.rmtree(d, ignore_errors=True)
    clip_vocab, clip_merges = write_clip(clip_dir)
    t5_vocab = write_t5(t5_dir)

    strings = test_strings()
    assert len(strings) >= 200 and len(set(strings)) == len(strings)

    clip = CLIPTokenizer.from_pretrained(clip_dir)
    t5 = T5TokenizerFast.from_pretrained(t5_dir)
    # The layout FluxPipeline loads: CLIP from vocab/merges, T5 from
    # tokenizer.json; check that is what happened.
    assert type(clip).__name__ == "CLIPTokenizer" and len(clip) == clip_vocab
    assert t5.backend_tokenizer.normalizer.__class__.__name__ == "Precompiled"

    out = {
        "generator": "tests/text/gen_tokenizer_fixtures.py",
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "strings": strings,
        "clip": {
            "dir": "clip",
            "max_lengths": CLIP_MAX_LENGTHS,
            "pad_id": clip.pad_token_id,
            "cases": run_cases(clip, strings, CLIP_MAX_LENGTHS, clip.pad_token_id),
        },
        "t5": {
            "dir": "t5",
            "max_lengths": T5_MAX_LENGTHS,
            "pad_id": t5.pad_token_id,
            "cases": run_cases(t5, strings, T5_MAX_LENGTHS, t5.pad_token_id),
        },
        "clip_variants": [],
        "t5_variants": [],
    }

    # Variants: checked on a subset of the strings (every third one, and
    # every one with markup or unusual whitespace), at one length each.
    subset = [
        k for k, s in enumerate(strings)
        if k % 3 == 0 or any(m in s for m in ("<", "!", "NEW", "  ", "\t", "\n", "\u00a0", "\u3000"))
        or s != s.strip()
    ]
    with open(os.path.join(clip_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        base_config = json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        for name, config, special_map in clip_variants(base_config, clip.bos_token_id,
                                                       clip.eos_token_id):
            d = os.path.join(tmp, name)
            os.makedirs(d)
            for fn in ("vocab.json", "merges.txt"):
                shutil.copyfile(os.path.join(clip_dir, fn), os.path.join(d, fn))
            for fn, content in (("tokenizer_config.json", config),
                                ("special_tokens_map.json", special_map)):
                if content is not None:
                    with open(os.path.join(d, fn), "w", encoding="utf-8") as f:
                        json.dump(content, f, indent=2)
            tok = CLIPTokenizer.from_pretrained(d)
            out["clip_variants"].append({
                "name": name,
                "tokenizer_config": config,
                "special_tokens_map": special_map,
                "max_length": 77,
                "pad_id": tok.pad_token_id,
                "cases": [variant_case(k, encode_case(tok, strings[k], 77, tok.pad_token_id))
                          for k in subset],
            })

    # transformers 5's own layout: save_pretrained writes tokenizer.json +
    # tokenizer_config.json only (no vocab.json / merges.txt). The C tests
    # rebuild that tokenizer.json from vocab.json, merges.txt and the
    # recorded added_tokens; check here that this is all it holds that
    # CLIPTokenizer reads.
    with tempfile.TemporaryDirectory() as tmp:
        clip.save_pretrained(tmp)
        assert sorted(os.listdir(tmp)) == ["tokenizer.json", "tokenizer_config.json"]
        with open(os.path.join(tmp, "tokenizer.json"), encoding="utf-8") as f:
            saved = json.load(f)
        with open(os.path.join(tmp, "tokenizer_config.json"), encoding="utf-8") as f:
            saved_config = json.load(f)
        with open(os.path.join(clip_dir, "vocab.json"), encoding="utf-8") as f:
            assert saved["model"]["vocab"] == json.load(f)
        with open(os.path.join(clip_dir, "merges.txt"), encoding="utf-8") as f:
            merges = [ln.split(" ") for ln in f.read().splitlines()[1:]]
        assert saved["model"]["merges"] == merges
        tok = CLIPTokenizer.from_pretrained(tmp)
        out["clip_variants"].append({
            "name": "saved_tokenizer_json",
            "layout": "tokenizer.json",
            "added_tokens": saved["added_tokens"],
            "tokenizer_config": saved_config,
            "special_tokens_map": None,
            "max_length": 77,
            "pad_id": tok.pad_token_id,
            "cases": [variant_case(k, encode_case(tok, strings[k], 77, tok.pad_token_id))
                      for k in subset],
        })

    with open(os.path.join(t5_dir, "tokenizer.json"), encoding="utf-8") as f:
        t5_json = json.load(f)
    for name, normalizer, pre_tokenizer, config in t5_variants(t5_json):
        spliced = splice_t5(t5_json, normalizer, pre_tokenizer)
        entry = {"name": name}
        if normalizer is not KEEP:
            entry["normalizer"] = normalizer
        if pre_tokenizer is not KEEP:
            entry["pre_tokenizer"] = pre_tokenizer
        if config is None:
            tok = Tokenizer.from_str(json.dumps(spliced))
            cases = [variant_case(k, encode_backend(tok, strings[k], 64, t5.pad_token_id, "<pad>"))
                     for k in subset]
        else:
            entry["tokenizer_config"] = config
            with tempfile.TemporaryDirectory() as tmp:
                with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
                    json.dump(spliced, f)
                with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
                    json.dump(config, f)
                tok = T5TokenizerFast.from_pretrained(tmp)
                cases = [variant_case(k, encode_case(tok, strings[k], 64, tok.pad_token_id))
                         for k in subset]
        entry.update(max_length=64, pad_id=t5.pad_token_id, cases=cases)
        out["t5_variants"].append(entry)

    path = os.path.join(args.out, "cases.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")

    def size(d):
        return sum(os.path.getsize(os.path.join(d, fn)) for fn in os.listdir(d))

    print(f"clip: {clip_vocab} tokens, {clip_merges} merges, {size(clip_dir)} bytes")
    print(f"t5:   {t5_vocab} tokens, {size(t5_dir)} bytes")
    print(f"cases: {len(strings)} strings, {len(subset)} per variant, "
          f"{os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
