"""HTTP API details checked against Go nsqd 1.3's source (nsqd/http.go, internal/http_api).

Each test pins one behaviour a client, a tool or a conformance suite can see,
with the exact status, headers and bytes Go nsqd writes.
"""

TOPIC_LINE = "   [{:<15}] depth: {:<5} be-depth: 0     msgs: {:<8} e2e%: "


async def test_text_stats_has_no_blank_line_after_topics_heading(nsqd_server, http):
    """printStats writes "\\nTopics:" without a newline, so the first topic follows at once."""
    for topic in ("a", "b"):
        assert (await http.post(f"/pub?topic={topic}", b"x")).status == 200
    text = (await http.get("/stats?include_mem=false")).body.decode()
    section = text[text.index("\nTopics:"):text.index("\nProducers:")]
    assert section == "\n".join([
        "",
        "Topics:",
        TOPIC_LINE.format("a", 1, 1),
        "",
        TOPIC_LINE.format("b", 1, 1),
        "",
    ])
