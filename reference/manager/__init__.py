"""The trajectory manager: an OpenAI-compatible server that agents talk to, which merges each session's
requests into one trajectory tree (`prefix_tree`: longest-prefix matching on token ids, generated tokens
kept with their logprob and policy version) and writes every finished request durably and append-only
(`store`: a journal folded into SQLite in WAL mode), so a restarted manager replays its trees and loses
nothing that finished.
"""
