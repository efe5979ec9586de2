"""Control-plane store: SQLAlchemy 2 tables for tenants, tenant–task policies and training jobs.

SQLite by default (one file under the data directory), any SQLAlchemy URL in production
(PostgreSQL is tested). Every writer transaction takes the database write lock up front on SQLite
(`BEGIN IMMEDIATE`), so two processes never both read-then-write the same rows; on PostgreSQL the
scheduler relies on row locks and compare-and-set updates instead. The scheduler's hot path runs
`Prepared` statements (compiled once per dialect) on `ControlPlaneStore.fast()`, a pooled DBAPI
connection, without SQLAlchemy's per-execute machinery.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    Index,
    Integer,
    Sequence,
    String,
    Text,
    bindparam,
    create_engine,
    event,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection, Dialect, Engine
from sqlalchemy.exc import DBAPIError, DisconnectionError, IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

SEQUENCE_NAMES = ("created_seq", "ready_seq")
# On PostgreSQL the counters are server sequences: nextval takes no row lock, whereas bumping a
# `sequences` row held it until the transaction's commit, so every concurrent reserve queued behind
# the one in flight (the 8-thread control-plane benchmark spent most of its backends' time waiting
# on it). SQLite keeps the table: its writers are serialized by BEGIN IMMEDIATE anyway.
POSTGRES_SEQUENCES = {name: Sequence(f"joynexus_{name}") for name in SEQUENCE_NAMES}


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Base(DeclarativeBase):
    pass


class TenantRecord(Base):
    __tablename__ = "tenants"

    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    task_type: Mapped[str] = mapped_column(String(16))
    base_model_id: Mapped[str] = mapped_column(String(512))
    schema_signature: Mapped[str] = mapped_column(String(64), index=True)
    spec: Mapped[dict] = mapped_column(JSON)
    backend_config: Mapped[dict] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), default="active")  # "active" | "unhealthy"
    # Why the tenant is unhealthy (e.g. its slot failed to build), so the others keep serving.
    status_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TrainingPolicyRecord(Base):
    """Admission policy of one tenant–task pair (paper A.2): priority, in-flight bound, completion target."""

    __tablename__ = "training_policies"

    policy_key: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    task_type: Mapped[str] = mapped_column(String(16))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    max_in_flight: Mapped[int] = mapped_column(Integer, default=1)
    completion_target: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_policy_staleness: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Bumped by every reservation: the UPDATE takes the row lock that serializes admission checks.
    reservations: Mapped[int] = mapped_column(BigInteger, default=0)


class TrainingJobRecord(Base):
    """The training-job descriptor of the paper's Table 3. It never holds tensors."""

    __tablename__ = "training_jobs"

    job_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    policy_key: Mapped[str] = mapped_column(String(128), index=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    task_type: Mapped[str] = mapped_column(String(16))
    partition_id: Mapped[str] = mapped_column(String(256), unique=True)
    sample_count: Mapped[int] = mapped_column(Integer)
    domain: Mapped[str] = mapped_column(String(64))
    job_metadata: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    created_seq: Mapped[int] = mapped_column(BigInteger)
    ready_seq: Mapped[int | None] = mapped_column(BigInteger, nullable=True, index=True)
    behavior_policy_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_policy_staleness: Mapped[int | None] = mapped_column(Integer, nullable=True)
    producer_role: Mapped[str] = mapped_column(String(64))
    consumer_role: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(32), index=True)
    lease_owner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # Times the job was re-queued because its lease owner died (bounded by recover_orphans' max_attempts).
    # server_default: the schema upgrade can add the column to a table that already holds rows.
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    terminal_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    result: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    ready_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    leased_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    __table_args__ = (
        # Admission counts a policy's jobs by state (reserve); leasing walks the ready jobs in lease order.
        Index("ix_training_jobs_policy_state", "policy_key", "state"),
        Index("ix_training_jobs_lease_order", "state", "priority", "ready_seq"),
    )


class WorkloadRecord(Base):
    """One run of a tenant's declared task, as the workload orchestrator admits and tracks it."""

    __tablename__ = "workloads"

    workload_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    task: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16), index=True)
    target_jobs: Mapped[int] = mapped_column(Integer, default=0)
    completed_jobs: Mapped[int] = mapped_column(Integer, default=0)
    version: Mapped[int] = mapped_column(Integer, default=0)
    optimizer_steps: Mapped[int] = mapped_column(Integer, default=0)
    last_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    registered_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    run_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    result: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # An SFT workload on another dataset than its tenant's (a resolved DatasetSpec as JSON: an
    # upload the tenant named by dataset.id); None: the tenant's own dataset.
    dataset: Mapped[dict | None] = mapped_column(JSON, nullable=True)


class SequenceRecord(Base):
    """Named monotonic counters (created_seq, ready_seq) shared by every process on the store."""

    __tablename__ = "sequences"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger, default=0)


# -- tenant API (joynexus.api): keys, metered usage, quotas ---------------------------------------


class ApiKeyRecord(Base):
    """An API key of the tenant API. Only the sha256 of the key is stored, never the key."""

    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)  # public part of the key, for lookup
    tenant_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)  # None for admin keys
    role: Mapped[str] = mapped_column(String(16))  # "tenant" | "admin"
    key_sha256: Mapped[str] = mapped_column(String(64))
    label: Mapped[str] = mapped_column(String(128), default="")
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class UsageRecord(Base):
    """One metered use of the shared services by a tenant through the tenant API (append-only)."""

    __tablename__ = "usage_records"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    category: Mapped[str] = mapped_column(String(16))  # "training" | "inference" | "environment"
    operation: Mapped[str] = mapped_column(String(32))  # e.g. "train_batch", "predict", "env_step"
    device_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    samples: Mapped[int] = mapped_column(Integer, default=0)
    env_steps: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TenantQuotaRecord(Base):
    """Per-tenant limits of the tenant API; a missing row or NULL column means the server default."""

    __tablename__ = "tenant_quotas"

    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    max_device_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    max_queued_workloads: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_storage_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # checkpoint bytes
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WorkloadEventRecord(Base):
    """A workload's progress events, durable so a stream resumes (Last-Event-ID) across a restart
    of the Master Service; `seq` is global and increasing."""

    __tablename__ = "workload_events"

    seq: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    workload_id: Mapped[str] = mapped_column(String(64), index=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    data: Mapped[dict] = mapped_column(JSON, default=dict)
    time: Mapped[float] = mapped_column(Float)


class EvaluationDeclarationRecord(Base):
    """An evaluation declaration (paper 4.2): target tenants and versions, one evaluation workload
    per target, and the comparison table once every one has ended."""

    __tablename__ = "evaluation_declarations"

    declaration_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    state: Mapped[str] = mapped_column(String(16), index=True)
    targets: Mapped[list] = mapped_column(JSON, default=list)  # [{tenant_id, version, workload_id}]
    table: Mapped[list | None] = mapped_column(JSON, nullable=True)  # one row per target
    run_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class TenantTombstoneRecord(Base):
    """The id of a deleted tenant whose artifacts (checkpoints, registered model) were kept: no new
    tenant may take the id (it would inherit them) until they are purged (issue 26)."""

    __tablename__ = "tenant_tombstones"

    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    reason: Mapped[str] = mapped_column(Text)
    deleted_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TenantForkRecord(Base):
    """A tenant made by `fork` (issue 41.3). `owner_tenant_id` is the tenant whose key made the
    first fork of the line (a fork of a fork has its source's owner): the line's spend and storage
    count against the owner's quotas, and the owner lists and deletes its forks."""

    __tablename__ = "tenant_forks"

    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner_tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    source_tenant_id: Mapped[str] = mapped_column(String(64))
    source_version: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ServingSetRecord(Base):
    """What the Inference Model Service serves for one tenant (`core/serving_sets.py`): its loaded
    versions and the one a request without a version gets, restored on every restart path."""

    __tablename__ = "serving_sets"

    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    versions: Mapped[list] = mapped_column(JSON, default=list)  # ascending
    pinned_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ControlPlaneStore:
    """Owns the engine and session factory; `transaction()` is the only way code writes."""

    def __init__(self, url: str):
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        if self.is_sqlite:
            self.engine: Engine = create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})
            _make_sqlite_transactions_immediate(self.engine)
        else:
            # No pool_pre_ping: it costs a round trip per checkout; connections idle for a while are
            # pinged at checkout instead (_ping_idle_connections), the hot path's are not.
            self.engine = create_engine(url, pool_size=5, max_overflow=5)
            _ping_idle_connections(self.engine)
        Base.metadata.create_all(self.engine)
        add_missing_columns(self.engine)
        add_missing_indexes(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._read_sessions = sessionmaker(self.engine.execution_options(**{_READ_ONLY: True}), expire_on_commit=False)
        for name in SEQUENCE_NAMES:
            self._ensure_sequence(name)
        if not self.is_sqlite:
            _ensure_postgres_sequences(self.engine)

    def _ensure_sequence(self, name: str) -> None:
        try:
            with self.transaction() as session:
                if session.get(SequenceRecord, name) is None:
                    session.add(SequenceRecord(name=name, value=0))
        except IntegrityError:
            pass  # another process created it first

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        with self._sessions.begin() as session:
            yield session

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """A write transaction on a Core connection (SQLite: `BEGIN IMMEDIATE`), for hot paths that
        need no ORM session; commits on exit, rolls back on an exception."""
        with self.engine.begin() as conn:
            yield conn

    @contextmanager
    def fast(self, *, single_statement: bool = False) -> Iterator[FastConnection]:
        """The scheduler's hot path: a pooled DBAPI connection running `Prepared` statements without
        SQLAlchemy's per-execute machinery, in one write transaction (SQLite: `BEGIN IMMEDIATE`;
        commits on exit, rolls back on an exception). `single_statement=True` promises that each
        statement is atomic on its own (a compare-and-set UPDATE, read-only checks after it): on
        PostgreSQL it then runs in autocommit, saving the BEGIN and COMMIT round trips. DBAPI
        errors surface as SQLAlchemy's exceptions; a lost connection is invalidated."""
        fairy = self.engine.raw_connection()
        dbapi_connection = fairy.driver_connection
        autocommit = single_statement and not self.is_sqlite
        fast = FastConnection(dbapi_connection, self.engine.dialect)
        try:
            if autocommit:
                dbapi_connection.autocommit = True
            elif self.is_sqlite:
                dbapi_connection.execute("BEGIN IMMEDIATE")
            yield fast
            if not autocommit:
                dbapi_connection.commit()
        except BaseException as error:
            self._fast_failed(fairy, fast, error, autocommit)
            raise
        finally:
            if autocommit and not dbapi_connection.closed:
                dbapi_connection.autocommit = False
            fairy.close()

    def _fast_failed(self, fairy: Any, fast: FastConnection, error: BaseException, autocommit: bool) -> None:
        dialect = self.engine.dialect
        dbapi_error = dialect.loaded_dbapi.Error
        if isinstance(error, dbapi_error) and dialect.is_disconnect(error, fairy.dbapi_connection, None):
            fairy.invalidate(error)  # the pool drops it instead of handing out a dead connection
            raise DBAPIError.instance(
                fast.last_sql, None, error, dbapi_error, connection_invalidated=True, dialect=dialect
            ) from error
        if not autocommit:
            try:
                fairy.driver_connection.rollback()
            except dbapi_error:
                fairy.invalidate()
        if isinstance(error, dbapi_error):
            raise DBAPIError.instance(fast.last_sql, None, error, dbapi_error, dialect=dialect) from error

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A transaction for pure reads: on SQLite a deferred `BEGIN` (a WAL snapshot that takes no
        write lock, so readers neither wait for nor block writers). Never write through it."""
        with self._read_sessions.begin() as session:
            yield session

    def dispose(self) -> None:
        self.engine.dispose()

    def next_sequence(self, conn: Connection | Session | FastConnection, name: str) -> int:
        """Allocate the next value of a named counter inside the caller's transaction. SQLite: one
        UPDATE ... RETURNING on the `sequences` table (allocations are serialized by the write lock
        anyway); PostgreSQL: nextval of its server sequence (no lock; a rolled-back allocation
        leaves a gap, which keeps the order)."""
        if name not in SEQUENCE_NAMES:
            raise KeyError(f"unknown sequence {name!r}; known: {SEQUENCE_NAMES}")
        if isinstance(conn, FastConnection):
            prepared = NEXT_SEQUENCE if self.is_sqlite else _NEXTVAL[name]
            row = conn.first(prepared, {"b_name": name})
            value = None if row is None else row[0]
        elif self.is_sqlite:
            value = conn.execute(_NEXT_SEQUENCE, {"b_name": name}).scalar_one_or_none()
        else:
            value = conn.execute(_NEXTVAL[name].statement).scalar_one_or_none()
        if value is None:
            raise KeyError(f"sequence {name!r} has no row in this store")
        return value


class Prepared:
    """A Core statement compiled once per dialect into its SQL text, the order and processors of
    its parameters and the result processors of its columns, so executing it is one DBAPI call
    (no compile-cache lookup, expanding-IN processing, execution context or Row objects).
    Parameters are passed by bind name; rows come back as tuples in the statement's column order."""

    __slots__ = ("statement", "_by_dialect")

    def __init__(self, statement: Any):
        self.statement = statement
        self._by_dialect: dict[tuple, _CompiledStatement] = {}

    def for_dialect(self, dialect: Dialect) -> _CompiledStatement:
        # What the compiled text and processors depend on (not id(dialect): ids of disposed
        # engines' dialects are reused, e.g. by a PostgreSQL store after a SQLite one).
        key = (type(dialect), dialect.paramstyle, dialect.server_version_info)
        compiled = self._by_dialect.get(key)
        if compiled is None:
            compiled = self._by_dialect[key] = _CompiledStatement(self.statement, dialect)
        return compiled


class _CompiledStatement:
    __slots__ = ("sql", "positional", "binds", "names", "result_processors")

    def __init__(self, statement: Any, dialect: Dialect):
        compiled = statement.compile(dialect=dialect)
        # Binds without a value are the caller's; the rest (IN lists of constant states...) are fixed.
        caller = {name for name, bind in compiled.binds.items() if bind.required}
        expanded = compiled.construct_expanded_state(dict.fromkeys(caller))
        self.sql = expanded.statement
        self.positional = bool(compiled.positional)
        base_of = {name: base for base, names in (expanded.parameter_expansion or {}).items() for name in names}
        order = expanded.positiontup if self.positional else list(expanded.parameters)
        # (name, is the caller's, processor or None, fixed value already processed)
        self.binds: list[tuple[str, bool, Callable[[Any], Any] | None, Any]] = []
        for name in order:
            processor = compiled._bind_processors.get(base_of.get(name, name))
            if name in caller:
                self.binds.append((name, True, processor, None))
            else:
                value = expanded.parameters[name]
                self.binds.append((name, False, None, processor(value) if processor else value))
        self.names = [name for name, *_ in self.binds]
        processors = [entry.type._cached_result_processor(dialect, None) for entry in compiled._result_columns]
        self.result_processors = list(enumerate(processors)) if any(processors) else []

    def parameters(self, params: Mapping[str, Any]) -> Any:
        values = [
            (processor(params[name]) if processor else params[name]) if caller else fixed
            for name, caller, processor, fixed in self.binds
        ]
        return values if self.positional else dict(zip(self.names, values, strict=True))

    def process_row(self, row: Any) -> tuple:
        if not self.result_processors:
            return tuple(row)
        out = list(row)
        for index, processor in self.result_processors:
            if processor is not None:
                out[index] = processor(out[index])
        return tuple(out)


class FastConnection:
    """A DBAPI connection of `ControlPlaneStore.fast()`: runs `Prepared` statements."""

    __slots__ = ("dbapi_connection", "dialect", "last_sql")

    def __init__(self, dbapi_connection: Any, dialect: Dialect):
        self.dbapi_connection = dbapi_connection
        self.dialect = dialect
        self.last_sql: str | None = None

    def first(self, prepared: Prepared, params: Mapping[str, Any]) -> tuple | None:
        """The first row (processed) or None, of a statement that returns rows (a SELECT or a
        DML statement with RETURNING); the rest of the rows are discarded."""
        compiled = prepared.for_dialect(self.dialect)
        self.last_sql = compiled.sql
        cursor = self.dbapi_connection.cursor()
        try:
            cursor.execute(compiled.sql, compiled.parameters(params))
            row = cursor.fetchone()  # not `description` first: psycopg builds column objects for it
        finally:
            cursor.close()
        return None if row is None else compiled.process_row(row)

    def script(self, steps: list[tuple[Prepared, Mapping[str, Any]]]) -> list[tuple[tuple | None, int]]:
        """PostgreSQL only: the statements sent as ONE query string (one round trip), parameters
        bound on the client by psycopg's quoting; outside a transaction the server runs them as one
        implicit transaction, each statement with its own snapshot. Returns (first row or None,
        rowcount) per statement. Bind names must not clash across the statements."""
        import psycopg

        compiled = [(prepared.for_dialect(self.dialect), params) for prepared, params in steps]
        merged: dict[str, Any] = {}
        for statement, params in compiled:
            merged.update(statement.parameters(params))
        self.last_sql = ";\n".join(statement.sql for statement, _ in compiled)
        cursor = psycopg.ClientCursor(self.dbapi_connection)
        results: list[tuple[tuple | None, int]] = []
        try:
            cursor.execute(self.last_sql, merged)
            for statement, _ in compiled:
                row = cursor.fetchone() if cursor.pgresult is not None and cursor.pgresult.nfields else None
                results.append((None if row is None else statement.process_row(row), cursor.rowcount))
                cursor.nextset()
        finally:
            cursor.close()
        return results

    def execute(self, prepared: Prepared, params: Mapping[str, Any]) -> int:
        """Run a statement without a result; returns its rowcount."""
        compiled = prepared.for_dialect(self.dialect)
        self.last_sql = compiled.sql
        cursor = self.dbapi_connection.cursor()
        try:
            cursor.execute(compiled.sql, compiled.parameters(params))
            return cursor.rowcount
        finally:
            cursor.close()


_SEQUENCES = SequenceRecord.__table__
_NEXT_SEQUENCE = (
    update(_SEQUENCES)
    .where(_SEQUENCES.c.name == bindparam("b_name"))
    .values(value=_SEQUENCES.c.value + 1)
    .returning(_SEQUENCES.c.value)
)  # built once: the scheduler allocates on every reserve and ready
NEXT_SEQUENCE = Prepared(_NEXT_SEQUENCE)
_NEXTVAL = {name: Prepared(select(sequence.next_value())) for name, sequence in POSTGRES_SEQUENCES.items()}
# Any constant: the transaction-scoped advisory lock that serializes creating the server sequences.
_SEQUENCES_LOCK_KEY = 0x6A6E5F736571


def _ensure_postgres_sequences(engine: Engine) -> None:
    """Create the counters' server sequences if absent, each starting after every number its
    `sequences` row (the counter before them) or a job row already holds, so numbers keep rising
    across the upgrade. Under an advisory lock, so concurrent first starts create each once; a
    sequence is visible (and drawn from) only after the transaction that created it committed."""
    with engine.begin() as conn:
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SEQUENCES_LOCK_KEY})
        for name, sequence in POSTGRES_SEQUENCES.items():
            if conn.execute(text("SELECT to_regclass(:name)"), {"name": sequence.name}).scalar() is not None:
                continue
            # `name` is a column of training_jobs and a row of sequences (constants of this module).
            floor = conn.execute(
                text(
                    "SELECT GREATEST(COALESCE((SELECT value FROM sequences WHERE name = :name), 0), "
                    f"COALESCE((SELECT MAX({name}) FROM training_jobs), 0))"
                ),
                {"name": name},
            ).scalar_one()
            conn.execute(text(f"CREATE SEQUENCE {sequence.name} START WITH {int(floor) + 1}"))


def add_missing_columns(engine: Engine) -> list[str]:
    """Schema upgrade: `create_all` creates missing tables but never alters existing ones, so add
    each model column an older database lacks (SQLite and PostgreSQL both take
    `ALTER TABLE ... ADD COLUMN` with a constant default). Returns the added "table.column" names."""
    added: list[str] = []
    ddl = engine.dialect.ddl_compiler(engine.dialect, None)
    prepare = engine.dialect.identifier_preparer
    for table in Base.metadata.sorted_tables:
        inspector = inspect(engine)
        if not inspector.has_table(table.name):
            continue
        present = {column["name"] for column in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name in present:
                continue
            spec = f"{prepare.format_column(column)} {column.type.compile(dialect=engine.dialect)}"
            default = ddl.get_column_default_string(column)
            if default is not None:
                spec += f" DEFAULT {default}"
                if not column.nullable:
                    spec += " NOT NULL"
            # Without a server default, existing rows could not satisfy NOT NULL: the column stays
            # nullable and the ORM's Python default fills it for new rows.
            try:
                with engine.begin() as conn:
                    conn.exec_driver_sql(f"ALTER TABLE {prepare.format_table(table)} ADD COLUMN {spec}")
            except DBAPIError:
                # Another process starting at the same time may have added it first.
                if column.name not in {c["name"] for c in inspect(engine).get_columns(table.name)}:
                    raise
                continue
            added.append(f"{table.name}.{column.name}")
    return added


def add_missing_indexes(engine: Engine) -> list[str]:
    """Schema upgrade: create the model indexes an older database lacks (`create_all` skips
    existing tables, their new indexes included). Returns the created index names."""
    created: list[str] = []
    for table in Base.metadata.sorted_tables:
        inspector = inspect(engine)
        if not inspector.has_table(table.name):
            continue
        present = {index["name"] for index in inspector.get_indexes(table.name)}
        for index in table.indexes:
            if index.name in present:
                continue
            try:
                index.create(engine)
            except DBAPIError:
                # Another process starting at the same time may have created it first.
                if index.name not in {i["name"] for i in inspect(engine).get_indexes(table.name)}:
                    raise
                continue
            created.append(index.name)
    return created


_READ_ONLY = "joynexus_read_only"


def _make_sqlite_transactions_immediate(engine: Engine) -> None:
    """pysqlite's deferred BEGIN lets two readers deadlock when both upgrade to writers; take the
    write lock at BEGIN instead (the SQLAlchemy-documented recipe), and wait for it via busy timeout."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=60000")
        # With WAL, NORMAL syncs at checkpoints instead of at every commit: a committed transaction
        # survives any process crash (it is in the WAL file, i.e. the OS); only an OS crash or power
        # loss may roll back the last commits, never corrupting the database.
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(connection) -> None:  # type: ignore[no-untyped-def]
        # Pure reads (ControlPlaneStore.read) take a snapshot without the write lock.
        connection.exec_driver_sql("BEGIN" if connection.get_execution_options().get(_READ_ONLY) else "BEGIN IMMEDIATE")


# A pooled connection unused for this long is pinged at checkout; a busy pool's connections are not.
PING_IDLE_AFTER_S = 2.0
_CHECKED_IN_AT = "joynexus_checked_in_at"


def _ping_idle_connections(engine: Engine) -> None:
    """`pool_pre_ping` without its round trip on every checkout: SQLAlchemy's documented pool
    `checkout` recipe (raising DisconnectionError makes the pool retry with a fresh connection),
    applied only to connections idle for PING_IDLE_AFTER_S, which is when a server restart or an
    idle timeout may have closed them."""

    @event.listens_for(engine, "checkin")
    def _checkin(_dbapi_connection, record) -> None:  # type: ignore[no-untyped-def]
        record.info[_CHECKED_IN_AT] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_connection, record, _proxy) -> None:  # type: ignore[no-untyped-def]
        checked_in = record.info.get(_CHECKED_IN_AT)
        if checked_in is None or time.monotonic() - checked_in < PING_IDLE_AFTER_S:
            return  # new (just connected) or recently used
        try:
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as error:
            if engine.dialect.is_disconnect(error, dbapi_connection, None):
                raise DisconnectionError(f"pooled connection is gone: {error}") from error
            raise
