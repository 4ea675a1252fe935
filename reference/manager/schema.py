"""The trajectory store's SQLite schema: its tables, and the columns of a stored record in the order
`records.from_row` reads them. A store names its format and version in `schema_version`; tables added since
version 1 (`ADDITIVE`) are created when missing, so older stores open unchanged."""

FORMAT = "seamlessflow-trajectory-store"
SCHEMA_VERSION = 1
SCHEMA = (
    "CREATE TABLE schema_version (format TEXT NOT NULL, version INTEGER NOT NULL)",
    "CREATE TABLE sessions (session_id TEXT PRIMARY KEY, created_s REAL NOT NULL)",
    """CREATE TABLE turns (
        session_id TEXT NOT NULL REFERENCES sessions (session_id),
        seq INTEGER NOT NULL,
        request_id TEXT NOT NULL,
        anchor_request_id TEXT,
        match_len INTEGER NOT NULL,
        num_tokens INTEGER NOT NULL,  -- prompt + generated: bounds the match_len of later anchored turns
        new_prompt_token_ids BLOB NOT NULL,  -- uint32 little-endian
        token_ids BLOB NOT NULL,  -- uint32 little-endian
        logprobs BLOB NOT NULL,  -- float64 little-endian
        versions BLOB NOT NULL,  -- int32 little-endian
        finish_reason TEXT NOT NULL,
        text TEXT NOT NULL,
        created_s REAL NOT NULL,
        meta TEXT NOT NULL,  -- JSON object
        PRIMARY KEY (session_id, seq),
        UNIQUE (session_id, request_id)
    )""",
)
ADDITIVE = (
    """CREATE TABLE IF NOT EXISTS annotations (
        session_id TEXT PRIMARY KEY,
        data TEXT NOT NULL,  -- JSON object: reward, branch_rewards, task_id, meta
        updated_s REAL NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS annotation_history (
        session_id TEXT NOT NULL,
        at_s REAL NOT NULL,
        author TEXT NOT NULL,  -- who wrote it: the caller's address and what it said about itself
        updates TEXT NOT NULL  -- JSON object: the fields this write set
    )""",
    "CREATE INDEX IF NOT EXISTS annotation_history_session ON annotation_history (session_id)",
    """CREATE TABLE IF NOT EXISTS consumed (
        item TEXT PRIMARY KEY,  -- what a training step consumed (a rollout group's key)
        step INTEGER NOT NULL,  -- the step that consumed it
        at_s REAL NOT NULL
    )""",
)
COLUMNS = (
    "session_id, seq, request_id, anchor_request_id, match_len, num_tokens, new_prompt_token_ids, token_ids, "
    "logprobs, versions, finish_reason, text, created_s, meta"
)
