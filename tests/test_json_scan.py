"""The JSON scan a row's field drafter carries across its proposals (decoding/json_scan.py,
`FieldDrafter.scan`; session 24): fed only the tokens committed since, it equals a scan of the
whole text (strings, escapes and brackets split across proposals); an output that does not
extend the last one is scanned anew (negative control: fed on top, it reads wrong)."""

from fixtures import four_level_fixtures

from specrouter.decoding.field_drafts import FieldDrafter
from specrouter.decoding.json_scan import JsonScan
from specrouter.engine.constrained import _text_codec

pool, prompts = four_level_fixtures()

TEXT = '{"items": [{"item": "say \\"hi\\", [then] {go}", "quantity": 2}, {"item": "b'


def state(scan: JsonScan):
    return scan.nest, scan.quoted, scan.escaped


def test_the_carried_scan_equals_a_scan_of_the_whole_text(pool):
    encode, decode, special = _text_codec(pool.tokenizer)
    fields = FieldDrafter(encode, decode, encode("Buy apples."), special)
    ids = encode(TEXT)
    for n in range(len(ids) + 1):  # one proposal per committed token, then a draft path after it
        assert state(fields.scan(ids[:n])) == state(JsonScan().feed(decode(ids[:n])))
        assert state(fields.scan(ids[:n], ids[n:])) == state(JsonScan().feed(TEXT))
    assert state(fields.scan(ids)) == (["{", "[", "{"], True, False)


OTHER = '{"items": [{"item": "apples and pears, to buy today", "quantity": 12}, {"item": "plums", "quantity": 3}]}'


def test_an_output_that_does_not_extend_the_last_is_scanned_anew(pool):
    encode, decode, special = _text_codec(pool.tokenizer)
    fields = FieldDrafter(encode, decode, encode("Buy apples."), special)
    text, other = encode(TEXT), encode(OTHER)
    assert len(other) > len(text)
    fields.scan(text)
    assert state(fields.scan(other)) == state(JsonScan().feed(OTHER)) == ([], False, False)
    fields.scan(other[:5])  # shorter: anew too
    assert state(fields.scan(text)) == state(JsonScan().feed(TEXT))
    # negative control: the last scan fed only the tokens past its length reads this output wrong
    assert state(JsonScan().feed(TEXT).feed(decode(other[len(text):]))) != ([], False, False)
