"""Texts of scripts written without spaces between words (Chinese, Japanese, Thai, Khmer, Burmese,
Lao) through tupe-prep: their words counted by characters (data_prep/sentences.py, count_words,
measured against ICU's word break in docs/data.md), so that --min-words keeps them, and their
sentences split at the script's own sentence ends (SAMPLES' sentences are the truth)."""

import pytest
from tokenizers import Tokenizer

from data_prep.clean import Cleaner
from data_prep import sentences as sentences_module
from data_prep.sentences import SentenceSplitter, count_words, join_short
from test_data_prep import documents_of, run, write_txt

ZWSP = "\u200b"
# language: (what separates its sentences in running text, its sentences, ICU's word count of
# them: PyICU 2.17, ICU 72, BreakIterator.createWordInstance, segments of rule status >= 100)
SAMPLES = {
    "chinese": ("", [
        "长城是中国古代的军事防御工程，也是世界上最著名的建筑之一。",
        "它东起山海关，西至嘉峪关，全长超过两万公里。",
        "早在春秋战国时期，各国就开始修筑城墙，以防御邻国的进攻。",
        "秦始皇统一六国以后，把各国的城墙连接起来，形成了万里长城的雏形。",
        "明朝是修筑长城规模最大的朝代，今天我们看到的长城大多是明代留下来的。",
        "长城不仅是一道城墙，还包括关隘、烽火台和驻军的城堡。",
        "当敌人来犯的时候，士兵们在烽火台上点燃烟火，把消息迅速传到远方。",
        "一九八七年，长城被联合国教科文组织列入世界文化遗产名录。",
        "每年都有数以百万计的游客来到北京附近的八达岭和慕田峪参观。",
        "有人说：“不到长城非好汉。”",
        "这句话表达了人们对长城的热爱和向往！",
        "可是，你知道长城为什么能保存到今天吗？",
        "除了坚固的材料以外，历代的维修和保护也起了重要的作用。",
        "近年来，政府投入大量资金修复受损的城段，并限制游客的数量。",
        "保护长城，就是保护我们共同的历史。",
    ], 206),
    "japanese": ("", [
        "富士山は日本で最も高い山で、標高は三七七六メートルです。",
        "静岡県と山梨県にまたがり、古くから信仰の対象とされてきました。",
        "二〇一三年には、世界文化遺産に登録されました。",
        "毎年七月から九月までの登山シーズンには、多くの人が山頂を目指します。",
        "山頂で日の出を見ることは「ご来光」と呼ばれ、特に人気があります。",
        "しかし、山の天気は変わりやすいので、十分な準備が必要です。",
        "夏でも山頂の気温は五度前後まで下がることがあります。",
        "富士山は江戸時代の浮世絵にもたびたび描かれました。",
        "葛飾北斎の「富嶽三十六景」はその代表的な作品です。",
        "現在では、外国からの観光客もたくさん訪れるようになりました。",
        "あなたも一度登ってみませんか？",
        "きっと忘れられない思い出になるでしょう！",
    ], 176),
    "thai": (" ", [
        "ประเทศไทยตั้งอยู่ในภูมิภาคเอเชียตะวันออกเฉียงใต้",
        "กรุงเทพมหานครเป็นเมืองหลวงและเป็นเมืองที่ใหญ่ที่สุดของประเทศ",
        "ภาษาไทยเป็นภาษาราชการที่คนส่วนใหญ่ใช้ในชีวิตประจำวัน",
        "อาหารไทยมีชื่อเสียงไปทั่วโลกเพราะมีรสชาติที่หลากหลาย",
        "นักท่องเที่ยวจำนวนมากเดินทางมาเที่ยวทะเลและภูเขาทุกปี",
        "ในฤดูฝนจะมีฝนตกเกือบทุกวันโดยเฉพาะในตอนบ่าย",
        "เทศกาลสงกรานต์เป็นวันขึ้นปีใหม่ตามประเพณีไทยในเดือนเมษายน",
        "ผู้คนจะสาดน้ำให้กันเพื่ออวยพรและคลายความร้อน",
        "วัดพระแก้วเป็นวัดที่สำคัญที่สุดแห่งหนึ่งในกรุงเทพ",
        "ทุกคนควรช่วยกันรักษาวัฒนธรรมอันดีงามนี้ไว้",
    ], 127),
    "khmer": (" ", [
        "ប្រទេសកម្ពុជាស្ថិតនៅក្នុងតំបន់អាស៊ីអាគ្នេយ៍។",
        "រាជធានីរបស់ប្រទេសកម្ពុជាគឺភ្នំពេញ។",
        "ប្រាសាទអង្គរវត្តគឺជាប្រាសាទដ៏ល្បីបំផុតនៅលើពិភពលោក។",
        "ភាសាខ្មែរជាភាសាផ្លូវការរបស់ប្រទេសនេះ។",
        "ប្រជាជនភាគច្រើនធ្វើការក្នុងវិស័យកសិកម្ម។",
        "ទន្លេមេគង្គហូរកាត់ប្រទេសពីខាងជើងទៅខាងត្បូង។",
        "បឹងទន្លេសាបគឺជាបឹងទឹកសាបធំជាងគេនៅអាស៊ីអាគ្នេយ៍។",
    ], 50),
    "burmese": (" ", [
        "မြန်မာနိုင်ငံသည်အရှေ့တောင်အာရှတွင်တည်ရှိသည်။",
        "နေပြည်တော်သည်မြန်မာနိုင်ငံ၏မြို့တော်ဖြစ်သည်။",
        "ရန်ကုန်သည်အကြီးဆုံးမြို့ဖြစ်သည်။",
        "ဧရာဝတီမြစ်သည်နိုင်ငံ၏အရေးကြီးဆုံးမြစ်ဖြစ်သည်။",
        "ပုဂံတွင်ဘုရားပေါင်းထောင်ချီရှိသည်။",
        "လူအများစုသည်ဗုဒ္ဓဘာသာကိုကိုးကွယ်ကြသည်။",
    ], 44),
    "lao": (" ", [
        "ປະເທດລາວຕັ້ງຢູ່ໃນອາຊີຕາເວັນອອກສ່ຽງໃຕ້",
        "ນະຄອນຫຼວງວຽງຈັນເປັນນະຄອນຫຼວງຂອງປະເທດ",
        "ແມ່ນ້ຳຂອງໄຫຼຜ່ານຫຼາຍແຂວງຂອງປະເທດລາວ",
        "ຄົນລາວສ່ວນຫຼາຍນັບຖືສາສະໜາພຸດ",
    ], 27),
}


def article(language: str) -> str:
    separator, sentences, _ = SAMPLES[language]
    return separator.join(sentences)


def with_zwsp(text: str) -> str:
    """The text with a zero-width space between its characters now and then, as Khmer, Burmese
    and Thai texts mark word boundaries."""
    return "".join(char + (ZWSP if i % 4 == 3 and char != " " else "")
                   for i, char in enumerate(text)).replace(ZWSP + " ", " ")


def test_words_are_counted_as_icu_segments_them():
    """Within 10% of ICU's count over each sample (they were measured within 5%: docs/data.md);
    zero-width spaces change nothing; spaced scripts count what is between spaces, as before."""
    for language, (_, sentences, icu) in SAMPLES.items():
        assert abs(count_words(Cleaner().normalize(article(language))) - icu) <= 0.1 * icu
        assert count_words(with_zwsp(article(language))) == count_words(article(language))
        assert all(count_words(sentence) >= 2 for sentence in sentences)
    assert count_words("東京は2020年にAI技術を") == 2 + round(5 / 1.75 + 3 / 1.5)
    assert count_words("Mr. Darcy   walked in.\tShe said „hello“") == 7
    assert count_words("→ ← ↑ ↓ ↔ ↕") == 6  # no word, as before: whitespace counts
    assert count_words("Ünïcödé ﬁne ligatures") == 3
    assert count_words("") == 0


@pytest.mark.parametrize("language", sorted(SAMPLES))
def test_sentences_are_split_at_the_scripts_sentence_ends(language):
    separator, sentences, _ = SAMPLES[language]
    text = Cleaner().normalize(article(language))
    expected = [Cleaner().normalize(sentence) for sentence in sentences]
    for splitter in ("fast", "sentencizer"):
        assert SentenceSplitter(min_words=1, splitter=splitter).split(text) == expected
        joined = SentenceSplitter(min_words=8, splitter=splitter).split(text)
        assert separator.join(joined) == text  # short sentences joined as the text has them
        assert all(count_words(sentence) >= 8 for sentence in joined[:-1])


def test_mixed_scripts_split_where_either_ends():
    splitter = SentenceSplitter(min_words=1)
    assert splitter.split("He left. 我走了。他说:「你好?」好的! ok then") == [
        "He left.", "我走了。", "他说:「你好?」", "好的!", "ok then"]


def test_articles_without_spaces_are_kept_and_split_into_sentences(tmp_path):
    """Chinese and Japanese articles, and Khmer, Burmese and Thai documents whose words are
    separated by zero-width spaces: none is dropped as short at the default --min-words, and
    each is written as its sentences (short ones joined) whose text is the document's."""
    documents = [article("chinese"), article("japanese")]
    for language in ("khmer", "burmese", "thai"):
        separator, sentences, _ = SAMPLES[language]
        documents += [with_zwsp(separator.join(sentences[i:i + 3])) for i in (0, 3)]
    documents += [with_zwsp("ภาษาไทย")]  # one word: dropped
    manifest = run([write_txt(tmp_path / "in.txt", documents)], tmp_path / "out", dedup="none")
    assert (manifest["documents_out"], manifest["short_dropped"]) == (8, 1)
    tokenizer = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    written = documents_of(tmp_path / "out" / "train", tokenizer)
    cleaned = [Cleaner().normalize(text) for text in documents[:8]]
    assert ["".join(doc) for doc in written[:2]] == cleaned[:2]
    assert [" ".join(doc) for doc in written[2:]] == cleaned[2:]
    assert [len(doc) for doc in written[:2]] == [15, 12]  # every sentence long enough
    assert all(len(doc) >= 2 for doc in written[2:])


def test_short_sentences_join_in_a_time_linear_in_the_page(monkeypatch):
    """Sentences ending inside words ("ab.Cd.", as spaCy cuts them) join by nothing and never
    reach --min-sentence-words: 1 MB of them took minutes while the joined text was counted
    again at each sentence. What each step counts is counted: a page of 24 KB shows it (a deadline
    on the clock failed in the loaded suite)."""
    sentences = ["ab.", "Cd."] * 4000
    text = "".join(sentences)
    counted = []
    monkeypatch.setattr(sentences_module, "count_words",
                        lambda piece: counted.append(len(piece)) or count_words(piece))
    joined = join_short(text, sentences, 4)
    assert "".join(joined) == text and len(joined) == len(sentences) // 4
    assert sum(counted) == len(text)  # each sentence counted once: the work is linear
