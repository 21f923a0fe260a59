//! Who is asking, on the CouchDB API: configured logins with Argon2 password hashes (PHC strings,
//! never clear text), HTTP Basic, and signed `AuthSession` cookies ([`super::session`]); then the
//! users of `_users` documents ([`super::users`]), checked against CouchDB's own hashes on the
//! same password-check threads and lockout, their document read at each request (a configured
//! name comes first).
//!
//! A request resolves to an [`Identity`]: the login name and roles, the [`Principal`] it acts as
//! on the data-store database (admin, one data-store user, or none for a login of the other
//! databases only) and how it proved it. With no logins configured the API is open and every
//! request acts as admin, as the REST API does with no tokens.
//!
//! Verifying a password hash costs tens of milliseconds on purpose, and CouchDB clients send Basic
//! credentials with every request, so credentials that verified once are remembered in a bounded
//! cache keyed by a keyed hash of name and password (never the password itself). Wrong passwords
//! are never cached: each one pays the full hash, on one of a few password-check threads.
//!
//! Failed logins are not free ([`Lockout`], like CouchDB 3.4's `chttpd_auth_lockout`): after
//! `couchdb_lockout_threshold` failures of one name from one peer address within
//! `couchdb_lockout_secs`, that pair is answered CouchDB's 403 ("Account is temporarily locked
//! due to multiple authentication failures") for the rest of that period, before any hash is run,
//! on Basic and `POST /_session` alike. And guesses cannot starve known-good credentials: a peer
//! with as many recent failures (of any names) has its password checks run in a lane of their own (one at a time, at
//! most `couchdb_max_queued_suspect_logins` waiting, 429 at once past that), so a login from
//! anyone else never queues behind a flood of guesses. Both tables are bounded in entries.
//!
//! With several instances over one backend, the (name, peer) failures are also counted in the
//! backend ([`super::shared_lockout`], set up by [`CouchAuth::share_lockout`]): the table here is
//! a cache in front of it. A pair this process knows locked is refused without a backend call; any
//! other pair reads the shared count once before its hash runs (a verified-credentials cache hit
//! runs no hash and reads nothing: those credentials were proven right). A backend that fails
//! while counting is logged and the count here goes on alone, never a 5xx. The per-peer suspect
//! lane stays per process: it guards this process's password-check threads, which no other
//! instance shares. The peer is the client's address behind `couchdb_trusted_proxies`
//! ([`super::client_address`]).

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use argon2::password_hash::{PasswordHash, PasswordHasher, SaltString};
use argon2::Argon2;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::sync::Semaphore;

use super::client_address::TrustedProxies;
use super::session::{hmac_sha256, CookieCheck, SessionKey, AUTH_SESSION_COOKIE};
use super::shared_lockout::{SharedCount, SharedFailures};
use super::users::UserDocs;
use crate::config::{CouchUserSetting, Settings};
use crate::database::users::StoredCredentials;
use crate::error::{Error, ErrorKind, Result};
use crate::model::Limits;

/// CouchDB's answer to a database request without valid credentials (fixture 007).
pub const NOT_AUTHORIZED_FOR_DB: &str = "You are not authorized to access this db.";
/// CouchDB's answer to a wrong name or password, on Basic and on `POST /_session` (fixture 008).
pub const WRONG_CREDENTIALS: &str = "Name or password is incorrect.";

/// CouchDB's answer to a locked-out name and peer (`couch_httpd_auth.erl`'s `LOCKOUT_MSG` in
/// CouchDB 3.4.3's source; its test suite's `auth_lockout_test.exs` expects the same text).
pub const LOCKED_OUT: &str = "Account is temporarily locked due to multiple authentication failures";

/// Credentials remembered after a successful verification. Each entry is a 32-byte key and a
/// pointer, so the cache stays under a megabyte.
const VERIFIED_CACHE_CAPACITY: usize = 4096;

pub use super::error::CouchError;

/// A JSON response; CouchDB labels every response `application/json`.
pub(super) fn json_response(status: StatusCode, body: &serde_json::Value) -> Response {
    let content_type = [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))];
    (status, content_type, body.to_string()).into_response()
}

pub use super::access::Principal;

/// How a request proved who it is; `GET /_session` reports it as `info.authenticated`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthMethod {
    /// No credentials (or none needed: the API is open).
    Anonymous,
    /// A valid `AuthSession` cookie.
    Cookie,
    /// `Authorization: Basic`.
    Basic,
}

impl AuthMethod {
    /// CouchDB's handler name, or `None` for anonymous requests (CouchDB then omits the field).
    pub fn handler_name(self) -> Option<&'static str> {
        match self {
            AuthMethod::Anonymous => None,
            AuthMethod::Cookie => Some("cookie"),
            AuthMethod::Basic => Some("default"),
        }
    }
}

/// What authentication found out about one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The login name; `None` for anonymous requests.
    pub name: Option<String>,
    /// Whom the request acts for on the data-store database; `None` when it is anonymous (and
    /// the API is not open), or for a login with neither `admin` nor `user` (it reaches only the
    /// other databases, as their `_security` admits it).
    pub principal: Option<Principal>,
    /// The login's configured CouchDB roles (`_admin` is not among them: it is the principal's).
    pub roles: Vec<String>,
    pub method: AuthMethod,
    /// A fresh `Set-Cookie` when the request's cookie has used more than a tenth of its life.
    pub refreshed_cookie: Option<HeaderValue>,
}

impl Identity {
    fn anonymous(principal: Option<Principal>) -> Self {
        Identity { name: None, principal, roles: Vec::new(), method: AuthMethod::Anonymous, refreshed_cookie: None }
    }

    fn of_login(login: &Login, method: AuthMethod, refreshed_cookie: Option<HeaderValue>) -> Self {
        Identity {
            name: Some(login.name.clone()),
            principal: login.principal.clone(),
            roles: login.roles.clone(),
            method,
            refreshed_cookie,
        }
    }

    /// The principal on the data-store database: CouchDB's 401 for a request without valid
    /// credentials, a 403 for a login that acts for no data-store user.
    pub fn require(&self) -> Result<&Principal, CouchError> {
        match (&self.principal, &self.name) {
            (Some(principal), _) => Ok(principal),
            (None, None) => Err(CouchError::unauthorized(NOT_AUTHORIZED_FOR_DB)),
            (None, Some(_)) => Err(CouchError::forbidden(NO_DATA_STORE_USER)),
        }
    }

    /// A login (or the open API): CouchDB's 401 for a request without valid credentials. Other
    /// databases decide the rest from their `_security`.
    pub fn require_login(&self) -> Result<(), CouchError> {
        if self.name.is_some() || self.principal.is_some() {
            Ok(())
        } else {
            Err(CouchError::unauthorized(NOT_AUTHORIZED_FOR_DB))
        }
    }

    /// A server admin (an `admin = true` login, or anyone when the API is open).
    pub fn is_server_admin(&self) -> bool {
        self.principal == Some(Principal::Admin)
    }

    /// The login as `_security` sees it.
    pub fn user_ctx(&self) -> super::access::UserCtx<'_> {
        super::access::UserCtx { name: self.name.as_deref(), roles: &self.roles, server_admin: self.is_server_admin() }
    }

    /// The roles `GET /_session` reports (`userCtx.roles`): `_admin` first for a server admin (as
    /// CouchDB lists an admin's), then the login's own; none for anonymous requests.
    pub fn session_roles(&self) -> Vec<String> {
        session_roles(self.principal.as_ref(), &self.roles)
    }

    /// Adds the refreshed session cookie to a response, unless the response sets `AuthSession`
    /// itself (a login or logout answers with its own cookie).
    pub fn add_refreshed_cookie(&self, response: &mut Response) {
        let Some(cookie) = &self.refreshed_cookie else { return };
        let sets_own =
            response.headers().get_all(header::SET_COOKIE).iter().any(|value| {
                value.to_str().is_ok_and(|v| v.trim_start().starts_with(&format!("{AUTH_SESSION_COOKIE}=")))
            });
        if !sets_own {
            response.headers_mut().append(header::SET_COOKIE, cookie.clone());
        }
    }
}

/// CouchDB's `userCtx.roles` of a login: `_admin` for a server admin, then its own roles.
fn session_roles(principal: Option<&Principal>, roles: &[String]) -> Vec<String> {
    let admin = (principal == Some(&Principal::Admin)).then(|| "_admin".to_owned());
    admin.into_iter().chain(roles.iter().cloned()).collect()
}

/// The 403 of a login with no data-store user on the data-store database.
pub const NO_DATA_STORE_USER: &str = "This login acts for no user of the data-store database: it may use only the \
     other databases whose _security names it or one of its roles.";

/// One login: configured, or a `_users` document's.
#[derive(Debug)]
struct Login {
    name: String,
    /// The PHC string, checked to parse as an Argon2 hash when the settings were loaded; for a
    /// `_users` document's login, its salt, which its session cookies are bound to.
    password_hash: String,
    /// The `_users` document's revision this login was read from; `None` for a configured one.
    users_rev: Option<String>,
    /// Its scope on the data-store database; `None`: it may not use that database.
    principal: Option<Principal>,
    /// Its CouchDB roles, for other databases' `_security`; none starts with `_` but `_metrics`.
    roles: Vec<String>,
}

/// The CouchDB API's logins, session key and verified-credentials cache.
#[derive(Debug)]
pub struct CouchAuth {
    logins: HashMap<String, Arc<Login>>,
    pub(super) sessions: SessionKey,
    verified: VerifiedCache,
    /// Password hashes verified at once: each Argon2 run holds its memory cost (19 MiB by
    /// default) on a blocking thread, so a flood of wrong passwords waits here instead of
    /// exhausting memory or the blocking pool.
    kdf_slots: Arc<Semaphore>,
    kdf_runs: AtomicU64,
    /// Failed logins by name and peer, and by peer.
    lockout: Lockout,
    /// The lane of password checks from peers with recent failures: one at a time.
    suspect_slots: Arc<Semaphore>,
    /// Checks waiting for the suspect lane, and how many may.
    suspect_waiting: Arc<AtomicUsize>,
    max_suspect_waiting: usize,
    /// Where the hashes run: one thread per slot of both lanes.
    kdf_threads: KdfThreads,
    /// Whose `X-Forwarded-For` names the client (`couchdb_trusted_proxies`).
    trusted_proxies: TrustedProxies,
    /// Where the `_users` documents' logins are read ([`CouchAuth::use_users_db`]).
    users: OnceLock<Arc<dyn UserDocs>>,
}

/// The lockout's settings.
#[derive(Debug, Clone, Copy)]
pub struct LockoutSettings {
    /// Failures that lock a (name, peer) pair; 0: no lockout.
    pub threshold: u32,
    /// How long failures count and a lockout lasts.
    pub period: Duration,
    /// Most pairs (and peers) remembered.
    pub max_entries: usize,
}

impl Default for LockoutSettings {
    /// CouchDB's defaults: `threshold = 5`, `max_lifetime = 300000` ms, `max_objects = 10000`.
    fn default() -> Self {
        LockoutSettings { threshold: 5, period: Duration::from_secs(300), max_entries: 10_000 }
    }
}

/// Failed logins per (name, peer) (the lockout) and per peer (which lane its checks take).
#[derive(Debug)]
struct Lockout {
    threshold: u32,
    period: Duration,
    by_name: FailureTable<(IpAddr, String)>,
    by_peer: FailureTable<IpAddr>,
    /// The (name, peer) counts every instance over the backend shares, once set up.
    shared: OnceLock<Arc<SharedFailures>>,
}

impl Lockout {
    fn new(settings: LockoutSettings) -> Self {
        Lockout {
            threshold: settings.threshold,
            period: settings.period,
            by_name: FailureTable::new(settings.period, settings.max_entries),
            by_peer: FailureTable::new(settings.period, settings.max_entries),
            shared: OnceLock::new(),
        }
    }

    /// Whether this process knows the pair locked: cheap, no backend call.
    fn is_locked(&self, peer: IpAddr, name: &str) -> bool {
        self.threshold > 0 && self.by_name.count(&(peer, name.to_owned()), Instant::now()) >= self.threshold
    }

    /// Whether the pair is locked by the failures every instance counted (read from the backend,
    /// and remembered here); by this process's count alone when there is no shared count or the
    /// backend cannot be read.
    async fn is_locked_anywhere(&self, peer: IpAddr, name: &str) -> bool {
        if self.threshold == 0 {
            return false;
        }
        if let Some(shared) = self.shared.get() {
            match shared.count(peer, name).await {
                Ok(Some(count)) => self.remember_shared(peer, name, count),
                Ok(None) => {}
                Err(err) => {
                    tracing::warn!(error = %err, "could not read a failed-login count; this process's count decides")
                }
            }
        }
        self.is_locked(peer, name)
    }

    /// Raises this process's count of a pair to the shared one.
    fn remember_shared(&self, peer: IpAddr, name: &str, count: SharedCount) {
        let now = Instant::now();
        let started = now.checked_sub(count.age).unwrap_or(now);
        self.by_name.raise_to((peer, name.to_owned()), count.failures, started, now);
    }

    /// Whether a peer's checks go to the suspect lane: as many recent failures from it, of any
    /// names, as would lock one name (at least one), so a typo or two does not slow an address
    /// (nor every client behind one proxy) while a guesser rotating names soon is.
    fn is_suspect(&self, peer: IpAddr) -> bool {
        self.by_peer.count(&peer, Instant::now()) >= self.threshold.max(1)
    }

    /// Counts a failure here and in the shared count; when the backend cannot count it, this
    /// process's count stands alone (logged), so a guesser is still locked here.
    async fn record_failure(&self, peer: IpAddr, name: &str) {
        let now = Instant::now();
        self.by_name.record((peer, name.to_owned()), now);
        self.by_peer.record(peer, now);
        let Some(shared) = self.shared.get() else { return };
        match shared.record(peer, name).await {
            Ok(count) => self.remember_shared(peer, name, count),
            Err(err) => {
                tracing::warn!(error = %err, "could not count a failed login in the backend; counted in this process only")
            }
        }
    }
}

/// Failures per key, counted from a key's first failure for `period`; at most `capacity` keys,
/// the oldest forgotten first.
#[derive(Debug)]
struct FailureTable<K> {
    period: Duration,
    capacity: usize,
    entries: Mutex<FailureEntries<K>>,
}

#[derive(Debug)]
struct FailureEntries<K> {
    counts: HashMap<K, (u32, Instant)>,
    /// Keys in the order their counts started (with that start, to skip keys counted again since).
    order: VecDeque<(K, Instant)>,
}

impl<K: Hash + Eq + Clone> FailureTable<K> {
    fn new(period: Duration, capacity: usize) -> Self {
        let entries = FailureEntries { counts: HashMap::new(), order: VecDeque::new() };
        FailureTable { period, capacity: capacity.max(1), entries: Mutex::new(entries) }
    }

    /// Failures of `key` in its current period.
    fn count(&self, key: &K, now: Instant) -> u32 {
        match self.lock().counts.get(key) {
            Some(&(count, started)) if now.duration_since(started) < self.period => count,
            _ => 0,
        }
    }

    fn record(&self, key: K, now: Instant) {
        self.update(key, now, |current| match current {
            Some((count, since)) => (count.saturating_add(1), since),
            None => (1, now),
        });
    }

    /// Takes a count kept elsewhere (`count` failures since `started`) unless this one is higher:
    /// its period then ends when the other's does.
    fn raise_to(&self, key: K, count: u32, started: Instant, now: Instant) {
        self.update(key, now, |current| match current {
            Some((mine, since)) if mine > count => (mine, since),
            _ => (count, started),
        });
    }

    /// Sets `key`'s count and the start of its period to `next` of its current ones (`None` for a
    /// key not counted or whose period is over), first forgetting periods that are over, then the
    /// oldest keys past the capacity.
    fn update(&self, key: K, now: Instant, next: impl FnOnce(Option<(u32, Instant)>) -> (u32, Instant)) {
        let mut entries = self.lock();
        let entries = &mut *entries;
        // Periods that are over go first: they are at the front.
        while let Some((oldest, started)) = entries.order.front() {
            if now.duration_since(*started) < self.period {
                break;
            }
            if entries.counts.get(oldest).is_some_and(|&(_, current)| current == *started) {
                entries.counts.remove(oldest);
            }
            entries.order.pop_front();
        }
        let current = entries.counts.get(&key).copied().filter(|&(_, since)| now.duration_since(since) < self.period);
        let (count, since) = next(current);
        if current.map(|(_, started)| started) != Some(since) {
            // A new period: the entry of the old one, if any, is skipped when it comes up.
            entries.order.push_back((key.clone(), since));
        }
        entries.counts.insert(key, (count, since));
        while entries.counts.len() > self.capacity {
            let Some((oldest, started)) = entries.order.pop_front() else { break };
            if entries.counts.get(&oldest).is_some_and(|&(_, current)| current == started) {
                entries.counts.remove(&oldest);
            }
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().counts.len()
    }

    /// Every change is a single insert, update or remove, so the table stays usable even if a
    /// holder panicked.
    fn lock(&self) -> std::sync::MutexGuard<'_, FailureEntries<K>> {
        self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Which lane a password check takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    Main,
    /// From a peer with recent failed logins.
    Suspect,
}

/// Takes a place in the suspect lane's waiting count; gives it back when dropped.
struct Waiting(Arc<AtomicUsize>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl CouchAuth {
    /// Reads `couchdb_users`, `couchdb_session_secret` and `couchdb_session_timeout_secs`; errors
    /// name the offending field.
    pub fn from_settings(settings: &Settings) -> Result<Self> {
        let limits = settings.store_options().limits;
        let mut logins = HashMap::new();
        for (i, entry) in settings.couchdb_users.entries()?.iter().enumerate() {
            let login = parse_login(i, entry, &limits)?;
            if logins.contains_key(&login.name) {
                let problem = format!("{:?} is configured twice", login.name);
                return Err(Error::invalid(&format!("couchdb_users[{i}].name"), problem));
            }
            logins.insert(login.name.clone(), Arc::new(login));
        }
        let sessions = SessionKey::from_settings(settings)?;
        let lockout = LockoutSettings {
            threshold: settings.couchdb_lockout_threshold,
            period: Duration::from_secs(settings.couchdb_lockout_secs),
            max_entries: settings.couchdb_lockout_max_entries,
        };
        let mut auth = CouchAuth::new(logins, sessions, lockout, settings.couchdb_max_queued_suspect_logins);
        auth.trusted_proxies = TrustedProxies::new(settings.couchdb_trusted_proxies.networks()?);
        Ok(auth)
    }

    /// Counts failed logins also in `backend` (the data-store database's), shared by every
    /// instance over it, and sweeps the counts whose period is over once a period. Only the first
    /// call takes effect.
    pub fn share_lockout(&self, backend: Arc<dyn crate::backend::DocumentBackend>) {
        if self.lockout.threshold == 0 || self.lockout.shared.get().is_some() {
            return;
        }
        let shared = Arc::new(SharedFailures::new(backend, self.lockout.period));
        if self.lockout.shared.set(Arc::clone(&shared)).is_ok() {
            super::shared_lockout::keep_swept(&shared);
        }
    }

    /// The address a request from `peer` counts under: the client behind a trusted proxy.
    pub fn client_address(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        self.trusted_proxies.client_of(peer, headers)
    }

    /// Signs sessions (and seals feed positions) under `current` from now on, still accepting
    /// those of `previous`: the secrets kept in the backend ([`super::shared_secret`]) when
    /// `couchdb_session_secret` is unset.
    pub fn use_session_secrets(&self, current: Vec<u8>, previous: Option<Vec<u8>>) {
        self.sessions.replace_secrets(current, previous);
    }

    fn new(
        logins: HashMap<String, Arc<Login>>,
        sessions: SessionKey,
        lockout: LockoutSettings,
        max_suspect_waiting: usize,
    ) -> Self {
        let parallelism = std::thread::available_parallelism().map_or(2, |n| n.get());
        CouchAuth {
            logins,
            sessions,
            verified: VerifiedCache::new(VERIFIED_CACHE_CAPACITY),
            kdf_slots: Arc::new(Semaphore::new(parallelism)),
            kdf_runs: AtomicU64::new(0),
            lockout: Lockout::new(lockout),
            suspect_slots: Arc::new(Semaphore::new(1)),
            suspect_waiting: Arc::new(AtomicUsize::new(0)),
            max_suspect_waiting,
            kdf_threads: KdfThreads::new(parallelism + 1),
            trusted_proxies: TrustedProxies::default(),
            users: OnceLock::new(),
        }
    }

    /// Logs in the users of `_users` documents too, after the configured logins (a configured
    /// name keeps its configured password and rights, as CouchDB's configured admins do). Only
    /// the first call takes effect.
    pub fn use_users_db(&self, users: Arc<dyn UserDocs>) {
        let _ = self.users.set(users);
    }

    /// No logins configured: every request acts as admin.
    pub fn is_open(&self) -> bool {
        self.logins.is_empty()
    }

    /// How many password hashes were verified since start (cache hits do not count).
    pub fn password_verifications(&self) -> u64 {
        self.kdf_runs.load(Ordering::Relaxed)
    }

    /// Whom the request acts for: `None` when it is anonymous and the API is not open. Wrong
    /// credentials are CouchDB's 401; a malformed header or cookie its 400.
    pub async fn authenticate(&self, headers: &HeaderMap) -> Result<Option<Principal>, CouchError> {
        Ok(self.identify(headers).await?.principal)
    }

    /// Everything authentication found out about the request. A valid `AuthSession` cookie wins
    /// over Basic credentials; an expired or forged one is ignored, as CouchDB does.
    pub async fn identify(&self, headers: &HeaderMap) -> Result<Identity, CouchError> {
        self.identify_at(headers, None, unix_now()).await
    }

    /// [`identify`](Self::identify) for a request from `peer`: failed Basic logins count toward
    /// the lockout of that name from that address.
    pub async fn identify_from(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> Result<Identity, CouchError> {
        self.identify_at(headers, peer, unix_now()).await
    }

    pub(super) async fn identify_at(
        &self,
        headers: &HeaderMap,
        peer: Option<IpAddr>,
        now: u64,
    ) -> Result<Identity, CouchError> {
        if self.is_open() {
            return Ok(Identity::anonymous(Some(Principal::Admin)));
        }
        if let Some(identity) = self.identify_cookie(headers, now).await? {
            return Ok(identity);
        }
        match basic_credentials(headers)? {
            None => Ok(Identity::anonymous(None)),
            Some((name, password)) => match self.verify_password(&name, &password, peer).await? {
                Some(login) => Ok(Identity::of_login(&login, AuthMethod::Basic, None)),
                None => Err(CouchError::unauthorized(WRONG_CREDENTIALS)),
            },
        }
    }

    /// The login a valid `AuthSession` cookie names, with a fresh cookie when it is due.
    async fn identify_cookie(&self, headers: &HeaderMap, now: u64) -> Result<Option<Identity>, CouchError> {
        let Some(value) = cookie_value(headers, AUTH_SESSION_COOKIE) else { return Ok(None) };
        let claim = SessionKey::parse(&value)?;
        let login = match self.logins.get(&claim.name) {
            Some(login) => login.clone(),
            // A `_users` login's cookie is bound to the salt its document has now (one read):
            // a new password, a new salt, and the old cookies stop working.
            None => match self.users_login(&claim.name).await? {
                Some((login, _)) => login,
                None => return Ok(None),
            },
        };
        let login = &login;
        let refreshed_cookie = match self.sessions.check(&claim, &login.password_hash, now) {
            CookieCheck::Valid { refresh: false } => None,
            CookieCheck::Valid { refresh: true } => {
                Some(self.sessions.set_cookie(&login.name, &login.password_hash, now))
            }
            CookieCheck::Expired | CookieCheck::BadSignature => return Ok(None),
        };
        Ok(Some(Identity::of_login(login, AuthMethod::Cookie, refreshed_cookie)))
    }

    /// A login for `POST /_session`: the roles it reports (`_admin` first for an admin) and the
    /// cookie to set, or `None` for a wrong name or password. With the API open any name is
    /// accepted as admin.
    pub(super) async fn log_in(
        &self,
        name: &str,
        password: &str,
        peer: Option<IpAddr>,
        now: u64,
    ) -> Result<Option<(Vec<String>, HeaderValue)>, CouchError> {
        if self.is_open() {
            return Ok(Some((session_roles(Some(&Principal::Admin), &[]), self.sessions.set_cookie(name, "", now))));
        }
        Ok(self.verify_password(name, password, peer).await?.map(|login| {
            let roles = session_roles(login.principal.as_ref(), &login.roles);
            (roles, self.sessions.set_cookie(&login.name, &login.password_hash, now))
        }))
    }

    /// The login these credentials prove, from the cache or by verifying the hash. A locked-out
    /// name and peer is CouchDB's 403 before anything else, as CouchDB checks it first.
    async fn verify_password(
        &self,
        name: &str,
        password: &str,
        peer: Option<IpAddr>,
    ) -> Result<Option<Arc<Login>>, CouchError> {
        if peer.is_some_and(|peer| self.lockout.is_locked(peer, name)) {
            return Err(CouchError::forbidden(LOCKED_OUT));
        }
        let key = self.verified.key_for(name, password);
        let candidate = self.candidate(name).await?;
        let remembered = self.verified.get(&key);
        if let (Some(hit), Some((login, _))) = (remembered, &candidate) {
            // A `_users` login is remembered for the document's revision it was verified
            // against: any change of the document (a new password) verifies again.
            if hit.name == login.name && hit.users_rev == login.users_rev {
                return Ok(Some(login.clone()));
            }
        }
        // Another instance may have counted this pair's failures: read them before the hash.
        if let Some(peer) = peer {
            if self.lockout.is_locked_anywhere(peer, name).await {
                return Err(CouchError::forbidden(LOCKED_OUT));
            }
        }
        // An unknown name is checked against another login's hash so that it takes as long as a
        // wrong password: response times do not tell which names exist.
        let (login, check) = match candidate {
            Some((login, check)) => (Some(login), check),
            None => match self.logins.values().next() {
                Some(other) => (None, PasswordCheck::Argon2(other.clone())),
                None => return Ok(None),
            },
        };
        let lane = match peer {
            Some(peer) if self.lockout.is_suspect(peer) => Lane::Suspect,
            _ => Lane::Main,
        };
        let matches = self.run_kdf(check, password.to_owned(), lane).await?;
        match login {
            Some(login) if matches => {
                self.verified.insert(key, login.clone());
                Ok(Some(login))
            }
            _ => {
                if let Some(peer) = peer {
                    self.lockout.record_failure(peer, name).await;
                }
                Ok(None)
            }
        }
    }

    /// The login `name` would be and how its password is checked: a configured login first,
    /// else a `_users` document's (read now); `None` for a name neither knows.
    async fn candidate(&self, name: &str) -> Result<Option<(Arc<Login>, PasswordCheck)>, CouchError> {
        if let Some(login) = self.logins.get(name) {
            return Ok(Some((login.clone(), PasswordCheck::Argon2(login.clone()))));
        }
        Ok(self.users_login(name).await?.map(|(login, stored)| (login, PasswordCheck::CouchDb(stored))))
    }

    /// The login of user `name`'s `_users` document and its stored hash; `None` without a
    /// document, or with one whose hash cannot be checked (logged: the login then fails as a
    /// wrong password does). CouchDB's 401 for a document with conflicts.
    async fn users_login(&self, name: &str) -> Result<Option<(Arc<Login>, StoredCredentials)>, CouchError> {
        let Some(users) = self.users.get() else { return Ok(None) };
        let Some(doc) = users.user_doc(name).await? else { return Ok(None) };
        if doc.conflicted {
            return Err(CouchError::unauthorized(super::users::CONFLICTED_USER_DOC));
        }
        let stored = match doc.credentials() {
            Ok(stored) => stored,
            Err(unusable) => {
                tracing::warn!(user = %name, reason = ?unusable, "a _users document's password hash is not checked");
                return Ok(None);
            }
        };
        let login = Login {
            name: name.to_owned(),
            password_hash: stored.salt().to_owned(),
            users_rev: Some(doc.rev.clone()),
            principal: None,
            roles: doc.roles(),
        };
        Ok(Some((Arc::new(login), stored)))
    }

    /// Verifies a password against a PHC string on a blocking thread, a few at a time, in its
    /// lane. The slot is held by the thread, so a client that hangs up does not free it before
    /// the hash is done.
    async fn run_kdf(&self, check: PasswordCheck, password: String, lane: Lane) -> Result<bool, CouchError> {
        let slots = match lane {
            Lane::Main => &self.kdf_slots,
            Lane::Suspect => {
                if self.suspect_waiting.fetch_add(1, Ordering::AcqRel) >= self.max_suspect_waiting {
                    self.suspect_waiting.fetch_sub(1, Ordering::AcqRel);
                    return Err(CouchError::new(
                        StatusCode::TOO_MANY_REQUESTS,
                        "too_many_requests",
                        format!(
                            "too many password checks from addresses with recent failed logins are waiting (at most \
                             {}: couchdb_max_queued_suspect_logins); try again later",
                            self.max_suspect_waiting
                        ),
                    ));
                }
                &self.suspect_slots
            }
        };
        let waiting = (lane == Lane::Suspect).then(|| Waiting(Arc::clone(&self.suspect_waiting)));
        let slot = slots.clone().acquire_owned().await.map_err(|_| CouchError::internal("password check closed"))?;
        drop(waiting);
        self.kdf_runs.fetch_add(1, Ordering::Relaxed);
        let (answer, answered) = tokio::sync::oneshot::channel();
        self.kdf_threads.run(Box::new(move || {
            let _slot = slot;
            let _ = answer.send(check.matches(&password));
        }))?;
        answered.await.map_err(|_| CouchError::internal("password check failed: its thread stopped"))
    }
}

/// How a login's password is checked: against a configured Argon2 PHC string, or against the
/// hash a `_users` document stores (CouchDB's PBKDF2 or `simple`).
enum PasswordCheck {
    /// A configured login's PHC string (`password_hash`), held by its login: finding a
    /// remembered login copies no string.
    Argon2(Arc<Login>),
    CouchDb(StoredCredentials),
}

impl PasswordCheck {
    fn matches(&self, password: &str) -> bool {
        match self {
            PasswordCheck::Argon2(login) => password_matches(&login.password_hash, password),
            PasswordCheck::CouchDb(stored) => stored.matches(password),
        }
    }
}

/// A password check to run on a KDF thread.
type KdfJob = Box<dyn FnOnce() + Send>;

/// The threads password hashes run on: as many as may run at once (the lanes' slots), kept for
/// the process's life. Not the blocking pool: each Argon2 run allocates its memory cost (19 MiB)
/// and the allocator keeps such blocks per thread arena, so hashes spread over the blocking
/// pool's changing threads left hundreds of megabytes resident after a flood of guesses; a few
/// fixed threads keep it to a few blocks.
#[derive(Debug)]
struct KdfThreads {
    jobs: Mutex<std::sync::mpsc::Sender<KdfJob>>,
}

impl KdfThreads {
    fn new(threads: usize) -> Self {
        let (jobs, queue) = std::sync::mpsc::channel::<KdfJob>();
        let queue = Arc::new(Mutex::new(queue));
        for i in 0..threads.max(1) {
            let queue = Arc::clone(&queue);
            let spawned = std::thread::Builder::new().name(format!("password-check-{i}")).spawn(move || loop {
                // The lock is held only to take a job; the job runs after it is released. The
                // thread ends when every sender is gone (the auth dropped).
                let job = match queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).recv() {
                    Ok(job) => job,
                    Err(_) => return,
                };
                job();
            });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot start a password-check thread");
            }
        }
        KdfThreads { jobs: Mutex::new(jobs) }
    }

    fn run(&self, job: KdfJob) -> Result<(), CouchError> {
        self.jobs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .send(job)
            .map_err(|_| CouchError::internal("password checks are not running"))
    }
}

/// Router middleware (`axum::middleware::from_fn_with_state(auth, identify_request)`): resolves
/// each request's [`Identity`] into its extensions for the handlers (`Extension<Identity>`;
/// [`Identity::require`] where a route needs credentials), answers wrong credentials and malformed
/// headers with CouchDB's 401/400 before any handler runs, and adds a refreshed session cookie to
/// the response when one is due.
pub async fn identify_request(
    axum::extract::State(auth): axum::extract::State<Arc<CouchAuth>>,
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let peer = client_connect_info(&auth, &mut request);
    // Boxed: this middleware's future is moved into axum's box on every request, and the
    // identification's (a `_users` read, a password hash on a blocking thread) is large; held
    // inline it would be copied with it.
    let identity = match Box::pin(auth.identify_from(request.headers(), peer)).await {
        Ok(identity) => identity,
        Err(err) => return err.into_response(),
    };
    let refresh = identity.refreshed_cookie.is_some().then(|| identity.clone());
    request.extensions_mut().insert(identity);
    let mut response = next.run(request).await;
    if let Some(identity) = refresh {
        identity.add_refreshed_cookie(&mut response);
    }
    response
}

/// The request's client address (behind a trusted proxy, the one it forwarded), put back in its
/// `ConnectInfo` so that every handler after this one (`POST /_session`, per-address feed bounds)
/// sees the client too: the one place the peer address is resolved.
fn client_connect_info(auth: &CouchAuth, request: &mut axum::extract::Request) -> Option<IpAddr> {
    let axum::extract::ConnectInfo(peer) = *request.extensions().get::<axum::extract::ConnectInfo<SocketAddr>>()?;
    let client = auth.client_address(peer.ip(), request.headers());
    if client != peer.ip() {
        // The port is the proxy's connection's, not the client's: none is known.
        request.extensions_mut().insert(axum::extract::ConnectInfo(SocketAddr::new(client, 0)));
    }
    Some(client)
}

/// Checks one configured login; errors name `couchdb_users[i]` and the field.
fn parse_login(i: usize, entry: &CouchUserSetting, limits: &Limits) -> Result<Login> {
    let field = |name: &str| format!("couchdb_users[{i}].{name}");
    let name = &entry.name;
    if name.is_empty() || name.contains(':') || name.chars().any(char::is_control) {
        return Err(Error::invalid(&field("name"), "must be non-empty, without `:` or control characters"));
    }
    check_password_hash(&entry.password_hash).map_err(|problem| Error::invalid(&field("password_hash"), problem))?;
    let principal = match (&entry.user, entry.admin) {
        (Some(user), false) => {
            limits.check_user_id(user).map_err(|e| Error::invalid(&field("user"), e.message()))?;
            Some(Principal::User(user.clone()))
        }
        (None, true) => Some(Principal::Admin),
        // Neither: a login of the other databases only, which their `_security` admits by name
        // or role.
        (None, false) => None,
        (Some(_), true) => {
            return Err(Error::invalid(
                &format!("couchdb_users[{i}]"),
                "takes at most one of `user = \"…\"` or `admin = true`",
            ))
        }
    };
    for (j, role) in entry.roles.iter().enumerate() {
        // CouchDB reserves roles starting with `_` (`_admin`, `_reader`…): a login gets `_admin`
        // only through `admin = true`. `_metrics` is the one of them CouchDB lets a user hold (its
        // `_users` validation admits it): it reads the node's statistics (`super::node`).
        let reserved = role.starts_with('_') && role != super::node::METRICS_ROLE;
        if role.is_empty() || reserved || role.chars().any(char::is_control) {
            return Err(Error::invalid(
                &field(&format!("roles[{j}]")),
                "must be non-empty, not start with `_` (CouchDB reserves those roles; `_metrics` is taken) and hold \
                 no control characters",
            ));
        }
    }
    Ok(Login {
        name: name.clone(),
        password_hash: entry.password_hash.clone(),
        users_rev: None,
        principal,
        roles: entry.roles.clone(),
    })
}

/// Whether a configured hash is an Argon2 PHC string this build can verify.
fn check_password_hash(phc: &str) -> std::result::Result<(), String> {
    let hint = "make one with `agentstore hash-password`";
    let parsed = PasswordHash::new(phc).map_err(|e| format!("is not a PHC string ({e}); {hint}"))?;
    let algorithm = argon2::Algorithm::try_from(parsed.algorithm).map_err(|_| {
        format!("uses {:?}; only Argon2 hashes (argon2id) are accepted; {hint}", parsed.algorithm.as_str())
    })?;
    argon2::Params::try_from(&parsed).map_err(|e| format!("has invalid {algorithm} parameters ({e}); {hint}"))?;
    if parsed.hash.is_none() || parsed.salt.is_none() {
        return Err(format!("has no salt or no hash; {hint}"));
    }
    Ok(())
}

thread_local! {
    /// This thread's Argon2 working memory, reused by every check it runs: a fresh 19 MiB
    /// allocation per check is what the allocator kept resident after a flood of guesses.
    static KDF_MEMORY: std::cell::RefCell<Vec<argon2::Block>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Whether the password matches the PHC string (which carries its own algorithm and parameters).
/// The hash is computed into this thread's reused memory and compared in constant time.
fn password_matches(phc: &str, password: &str) -> bool {
    let Ok(hash) = PasswordHash::new(phc) else { return false };
    let (Ok(algorithm), Ok(params)) = (argon2::Algorithm::try_from(hash.algorithm), argon2::Params::try_from(&hash))
    else {
        return false;
    };
    let Ok(version) = hash.version.map_or(Ok(argon2::Version::V0x13), argon2::Version::try_from) else { return false };
    let (Some(salt), Some(expected)) = (hash.salt, hash.hash) else { return false };
    let mut salt_bytes = [0u8; 64];
    let Ok(salt) = salt.decode_b64(&mut salt_bytes) else { return false };
    let mut computed = vec![0u8; expected.len()];
    let blocks = params.block_count();
    let argon2 = Argon2::new(algorithm, version, params);
    let hashed = KDF_MEMORY.with(|memory| {
        let mut memory = memory.borrow_mut();
        memory.resize(blocks, argon2::Block::default());
        argon2.hash_password_into_with_memory(password.as_bytes(), salt, &mut computed, &mut memory[..])
    });
    hashed.is_ok() && argon2::password_hash::Output::new(&computed).is_ok_and(|computed| computed == expected)
}

/// The PHC string of a password: Argon2id with the crate's default (OWASP) parameters and a
/// random 16-byte salt. This is what `agentstore hash-password` prints.
pub fn hash_password(password: &str) -> Result<String> {
    if password.is_empty() {
        return Err(Error::invalid("password", "is empty"));
    }
    let mut salt = [0u8; 16];
    getrandom::fill(&mut salt).map_err(|e| Error::new(ErrorKind::Internal, format!("no random salt: {e}")))?;
    let salt = SaltString::encode_b64(&salt).map_err(|e| Error::new(ErrorKind::Internal, format!("salt: {e}")))?;
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map(|hash| hash.to_string())
        .map_err(|e| Error::new(ErrorKind::Internal, format!("cannot hash the password: {e}")))
}

/// The name and password of an `Authorization: Basic` header. `None` without the header, for a
/// header that is not `Basic ` followed by credentials (another scheme, `Basic` alone, `Basic:`
/// as PouchDB's test helper sends it), without a `:` in the credentials, or for CouchDB's log-out
/// credentials `_:_`: CouchDB (`couch_httpd_auth:basic_name_pw`) ignores all of those and
/// answers as to an anonymous client. Only bad base64 after `Basic ` is its 400. The scheme is
/// matched without regard to case (RFC 7617), where CouchDB takes `Basic` alone.
fn basic_credentials(headers: &HeaderMap) -> Result<Option<(String, String)>, CouchError> {
    let Some(value) = headers.get(header::AUTHORIZATION) else { return Ok(None) };
    const SCHEME: &str = "basic ";
    let Some(encoded) = value
        .to_str()
        .ok()
        .map(str::trim)
        .filter(|value| value.get(..SCHEME.len()).is_some_and(|scheme| scheme.eq_ignore_ascii_case(SCHEME)))
        .map(|value| &value[SCHEME.len()..])
    else {
        return Ok(None);
    };
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .map_err(|_| CouchError::bad_request("Authorization header has invalid base64 value"))?;
    let mut name =
        String::from_utf8(decoded).map_err(|_| CouchError::bad_request("Authorization credentials are not UTF-8"))?;
    let Some(colon) = name.find(':') else { return Ok(None) };
    if name == "_:_" {
        return Ok(None);
    }
    // The decoded text becomes the name: one copy (the password's) per request, not two.
    let password = name[colon + 1..].to_owned();
    name.truncate(colon);
    Ok(Some((name, password)))
}

/// The value of a named cookie in the request's `Cookie` headers; `None` when absent or empty.
pub(super) fn cookie_value(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value.trim().trim_matches('"').to_owned())
        .filter(|value| !value.is_empty())
}

/// Seconds since the Unix epoch.
pub(super) fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Credentials that verified, keyed by HMAC-SHA256 of name and password under a random
/// per-process key, so neither a memory dump nor the key set yields a fast password hash.
/// Oldest entries go first when it is full.
///
/// The HMAC is keyed once, at start: `keyed` holds the hash states after the key's inner and
/// outer blocks, and each request's key starts from a copy of them. That is the same HMAC of the
/// same key (unit `the_cache_key_is_the_hmac_of_name_and_password`), computed with two of its
/// four SHA-256 blocks instead of four: keying it per request hashed the same two key blocks
/// again for every Basic request (issue 38, docs/benchmarks.md "In front of CouchDB (session
/// 21)"). What the process keeps is what it kept: no password, and key material (the two states
/// derive from the random key and nothing else) that only this process holds.
#[derive(Debug)]
struct VerifiedCache {
    keyed: Hmac<Sha256>,
    capacity: usize,
    entries: Mutex<CacheEntries>,
}

#[derive(Debug, Default)]
struct CacheEntries {
    logins: HashMap<[u8; 32], Arc<Login>>,
    order: VecDeque<[u8; 32]>,
}

impl VerifiedCache {
    fn new(capacity: usize) -> Self {
        let mut key = [0u8; 32];
        // Without the OS generator the key stays fixed; the cache still never holds a password.
        let _ = getrandom::fill(&mut key);
        Self::with_key(&key, capacity)
    }

    fn with_key(key: &[u8], capacity: usize) -> Self {
        VerifiedCache { keyed: hmac_sha256(key), capacity, entries: Mutex::new(CacheEntries::default()) }
    }

    fn key_for(&self, name: &str, password: &str) -> [u8; 32] {
        let mut mac = self.keyed.clone();
        // Length-prefixed, so no other name and password split the same bytes differently.
        mac.update(&(name.len() as u64).to_be_bytes());
        mac.update(name.as_bytes());
        mac.update(password.as_bytes());
        mac.finalize().into_bytes().into()
    }

    fn get(&self, key: &[u8; 32]) -> Option<Arc<Login>> {
        self.lock().logins.get(key).cloned()
    }

    fn insert(&self, key: [u8; 32], login: Arc<Login>) {
        let mut entries = self.lock();
        if entries.logins.insert(key, login).is_none() {
            entries.order.push_back(key);
        }
        while entries.order.len() > self.capacity {
            if let Some(oldest) = entries.order.pop_front() {
                entries.logins.remove(&oldest);
            }
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().logins.len()
    }

    /// The map stays consistent even if a holder panicked: every change is a single insert or
    /// remove.
    fn lock(&self) -> std::sync::MutexGuard<'_, CacheEntries> {
        self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::config::Overrides;
    use argon2::{Algorithm, Params, Version};
    use std::time::Duration;

    /// An Argon2id hash with the smallest parameters, so tests do not wait on the KDF.
    pub(in crate::couchdb_api) fn cheap_hash(password: &str) -> String {
        let argon2 = Argon2::new(Algorithm::Argon2id, Version::V0x13, Params::new(8, 1, 1, None).unwrap());
        let salt = SaltString::encode_b64(b"sixteen byte sal").unwrap();
        argon2.hash_password(password.as_bytes(), &salt).unwrap().to_string()
    }

    /// Settings loaded from a TOML text, as `--config FILE` would.
    pub(in crate::couchdb_api) fn settings(toml: &str) -> Result<Settings> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agentstore.toml");
        std::fs::write(&path, toml).unwrap();
        Settings::load(Some(&path), &Overrides::default())
    }

    /// Logins `admin` (password `admin-pw`) and `alice` (password `alice-pw`, data-store user
    /// `user_123`), with a fixed session secret.
    pub(in crate::couchdb_api) fn two_logins() -> CouchAuth {
        let toml = format!(
            "couchdb_session_secret = \"{}\"\n\
             [[couchdb_users]]\nname = \"admin\"\npassword_hash = \"{}\"\nadmin = true\n\
             [[couchdb_users]]\nname = \"alice\"\npassword_hash = \"{}\"\nuser = \"user_123\"\n",
            "ab".repeat(32),
            cheap_hash("admin-pw"),
            cheap_hash("alice-pw"),
        );
        CouchAuth::from_settings(&settings(&toml).unwrap()).unwrap()
    }

    pub(in crate::couchdb_api) fn basic(name: &str, password: &str) -> HeaderMap {
        let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{name}:{password}"));
        authorization(&format!("Basic {encoded}"))
    }

    fn authorization(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        headers
    }

    /// Status and body of a CouchDB 3.4.3 transcript's response.
    pub(in crate::couchdb_api) fn fixture_response(text: &str) -> (StatusCode, serde_json::Value) {
        let fixture: serde_json::Value = serde_json::from_str(text).unwrap();
        let status = StatusCode::from_u16(fixture["response"]["status"].as_u64().unwrap() as u16).unwrap();
        (status, fixture["response"]["body"].clone())
    }

    pub(in crate::couchdb_api) const AUTH_NONE: &str =
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/couchdb-3.4.3/007-auth-none.json"));
    pub(in crate::couchdb_api) const AUTH_WRONG_PASSWORD: &str =
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/couchdb-3.4.3/008-auth-wrong-password.json"));

    #[tokio::test]
    async fn basic_credentials_resolve_to_their_login_and_principal() {
        let auth = two_logins();
        assert!(!auth.is_open());
        let admin = auth.identify(&basic("admin", "admin-pw")).await.unwrap();
        assert_eq!(
            admin,
            Identity {
                name: Some("admin".into()),
                principal: Some(Principal::Admin),
                roles: Vec::new(),
                method: AuthMethod::Basic,
                refreshed_cookie: None
            }
        );
        assert_eq!(admin.session_roles(), vec!["_admin"]);
        let alice = auth.identify(&basic("alice", "alice-pw")).await.unwrap();
        assert_eq!(alice.principal, Some(Principal::User("user_123".into())));
        assert!(alice.session_roles().is_empty());
        // The scheme is case-insensitive; a password may hold `:`.
        let mut lower = basic("alice", "alice-pw");
        let value = lower[header::AUTHORIZATION].to_str().unwrap().replacen("Basic", "basic", 1);
        lower.insert(header::AUTHORIZATION, HeaderValue::from_str(&value).unwrap());
        assert_eq!(auth.authenticate(&lower).await.unwrap(), Some(Principal::User("user_123".into())));
    }

    #[tokio::test]
    async fn wrong_or_missing_credentials_answer_couchdbs_401_bodies() {
        let auth = two_logins();
        let (status, body) = fixture_response(AUTH_WRONG_PASSWORD);
        for (name, password) in [("admin", "wrong"), ("alice", "admin-pw"), ("nobody", "alice-pw"), ("admin", "")] {
            let err = auth.identify(&basic(name, password)).await.unwrap_err();
            assert_eq!((err.status, err.body()), (status, body.clone()), "{name}:{password}");
        }
        // No credentials: anonymous, which a database request refuses with fixture 007's answer.
        let anonymous = auth.identify(&HeaderMap::new()).await.unwrap();
        assert_eq!(anonymous, Identity::anonymous(None));
        let err = anonymous.require().unwrap_err();
        assert_eq!((err.status, err.body()), fixture_response(AUTH_NONE));
        let response = err.into_response();
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
    }

    #[tokio::test]
    async fn malformed_authorization_headers_are_anonymous_and_bad_base64_400() {
        let auth = two_logins();
        let err = auth.identify(&authorization("Basic !!!not-base64")).await.unwrap_err();
        assert_eq!(
            (err.status, err.reason.as_str()),
            (StatusCode::BAD_REQUEST, "Authorization header has invalid base64 value")
        );
        // `_:_` is CouchDB's way to drop Basic credentials; no `:` at all carries none; a header
        // that is not `Basic <credentials>` is ignored, as `couch_httpd_auth:basic_name_pw` does.
        let alice = base64::engine::general_purpose::STANDARD.encode("alice:alice-pw");
        for headers in [
            basic("_", "_"),
            authorization("Basic YWxpY2U="),
            authorization("Bearer abc"),
            authorization("Basic"),
            authorization(&format!("Basic: {alice}")),
            authorization(&format!("Basic:{alice}")),
        ] {
            assert_eq!(auth.identify(&headers).await.unwrap(), Identity::anonymous(None), "{headers:?}");
        }
    }

    #[tokio::test]
    async fn no_logins_configured_is_open_and_everyone_is_admin() {
        let auth = CouchAuth::from_settings(&settings("").unwrap()).unwrap();
        assert!(auth.is_open());
        for headers in [HeaderMap::new(), basic("anyone", "anything")] {
            let identity = auth.identify(&headers).await.unwrap();
            assert_eq!(identity, Identity::anonymous(Some(Principal::Admin)));
            assert_eq!(identity.require().unwrap(), &Principal::Admin);
        }
        assert_eq!(auth.password_verifications(), 0);
    }

    #[tokio::test]
    async fn a_verified_password_is_remembered_and_not_hashed_again() {
        let auth = two_logins();
        auth.authenticate(&basic("alice", "alice-pw")).await.unwrap();
        assert_eq!(auth.password_verifications(), 1);
        for _ in 0..5 {
            assert!(auth.authenticate(&basic("alice", "alice-pw")).await.unwrap().is_some());
        }
        assert_eq!(auth.password_verifications(), 1, "cache hits run no KDF");
        // Wrong passwords are never remembered: each one pays the hash again.
        for expected in [2, 3] {
            auth.authenticate(&basic("alice", "guess")).await.unwrap_err();
            assert_eq!(auth.password_verifications(), expected);
        }
        // Another login's entry is its own.
        auth.authenticate(&basic("admin", "admin-pw")).await.unwrap();
        assert_eq!(auth.password_verifications(), 4);
        assert_eq!(auth.verified.len(), 2);
        // An unknown name is hashed too (against another login's hash), so it is not faster.
        auth.authenticate(&basic("mallory", "alice-pw")).await.unwrap_err();
        assert_eq!(auth.password_verifications(), 5);
    }

    #[tokio::test]
    async fn a_hung_up_client_keeps_its_kdf_slot_until_the_hash_is_done() {
        // A hash slow enough to still be running when the request is dropped.
        let argon2 = Argon2::new(Algorithm::Argon2id, Version::V0x13, Params::new(64, 3000, 1, None).unwrap());
        let salt = SaltString::encode_b64(b"sixteen byte sal").unwrap();
        let slow = argon2.hash_password(b"pw", &salt).unwrap().to_string();
        let toml = format!("[[couchdb_users]]\nname = \"a\"\npassword_hash = \"{slow}\"\nadmin = true\n");
        let auth = CouchAuth::from_settings(&settings(&toml).unwrap()).unwrap();
        let slots = auth.kdf_slots.available_permits();
        let dropped = tokio::time::timeout(Duration::from_millis(20), auth.authenticate(&basic("a", "wrong"))).await;
        assert!(dropped.is_err(), "the hash finished within 20 ms; make it slower");
        assert_eq!(auth.kdf_slots.available_permits(), slots - 1, "the running hash still holds its slot");
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while auth.kdf_slots.available_permits() < slots {
            assert!(std::time::Instant::now() < deadline, "the slot never came back");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn the_middleware_hands_handlers_the_identity_and_refreshes_cookies() {
        use axum::routing::get;
        use tower::ServiceExt;

        let auth = Arc::new(two_logins());
        let who = |axum::Extension(identity): axum::Extension<Identity>| async move {
            match identity.require() {
                Ok(principal) => format!("{:?} {principal:?}", identity.name).into_response(),
                Err(err) => err.into_response(),
            }
        };
        let app = axum::Router::new()
            .route("/db", get(who))
            .layer(axum::middleware::from_fn_with_state(auth.clone(), identify_request));
        let call = |headers: HeaderMap| {
            let app = app.clone();
            async move {
                let mut request = axum::extract::Request::get("/db").body(axum::body::Body::empty()).unwrap();
                *request.headers_mut() = headers;
                let response = app.oneshot(request).await.unwrap();
                let status = response.status();
                let set_cookie = response.headers().get(header::SET_COOKIE).cloned();
                let body = axum::body::to_bytes(response.into_body(), 1 << 16).await.unwrap();
                (status, String::from_utf8(body.to_vec()).unwrap(), set_cookie)
            }
        };
        let (status, body, _) = call(basic("alice", "alice-pw")).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "Some(\"alice\") User(\"user_123\")"));
        let (status, body, _) = call(basic("alice", "nope")).await;
        assert_eq!((status, serde_json::from_str(&body).unwrap()), fixture_response(AUTH_WRONG_PASSWORD));
        let (status, body, _) = call(HeaderMap::new()).await;
        assert_eq!((status, serde_json::from_str(&body).unwrap()), fixture_response(AUTH_NONE));

        let aging = auth.sessions.sign("admin", &cheap_hash("admin-pw"), unix_now() - 100);
        let mut headers = HeaderMap::new();
        headers.insert(header::COOKIE, HeaderValue::from_str(&format!("AuthSession={aging}")).unwrap());
        let (status, body, set_cookie) = call(headers).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "Some(\"admin\") Admin"));
        assert!(set_cookie.expect("a refreshed cookie").to_str().unwrap().starts_with("AuthSession="));
    }

    #[test]
    fn the_cache_is_bounded_and_drops_the_oldest_and_holds_no_password() {
        let cache = VerifiedCache::new(2);
        let login = Arc::new(Login {
            name: "a".into(),
            password_hash: String::new(),
            users_rev: None,
            principal: Some(Principal::Admin),
            roles: Vec::new(),
        });
        let keys: Vec<[u8; 32]> = ["one", "two", "three"].iter().map(|pw| cache.key_for("a", pw)).collect();
        for key in &keys {
            cache.insert(*key, login.clone());
        }
        assert_eq!(cache.len(), 2);
        assert!(cache.get(&keys[0]).is_none());
        assert!(cache.get(&keys[1]).is_some() && cache.get(&keys[2]).is_some());
        // Keys depend on how name and password split, and on the per-process key.
        assert_ne!(cache.key_for("ab", "c"), cache.key_for("a", "bc"));
        assert_ne!(VerifiedCache::new(2).key_for("a", "one"), keys[0]);
    }

    /// The key of a request is the HMAC-SHA256 of the name's length (8 bytes, big-endian), the
    /// name and the password under the cache's key, the same on every request although the HMAC
    /// is keyed once. The expected values come from Python's `hmac` module, not from this code.
    #[test]
    fn the_cache_key_is_the_hmac_of_name_and_password() {
        let cache = VerifiedCache::with_key(&[7u8; 32], 2);
        let hex = |key: [u8; 32]| key.iter().map(|byte| format!("{byte:02x}")).collect::<String>();
        for _ in 0..2 {
            assert_eq!(
                hex(cache.key_for("alice", "pass:word")),
                "0deb77af9e06d0ddb3037cd6eac10761b1eab938cef4069e63eee88a3a7b4bdb"
            );
            assert_eq!(
                hex(cache.key_for("alice", "other")),
                "466dd59cd3380631d633ccb53b3b8810783ba32bb63f1c13848fb2558c1ee42d"
            );
        }
    }

    fn peer(last: u8) -> Option<IpAddr> {
        Some(IpAddr::from([192, 0, 2, last]))
    }

    /// CouchDB 3.4.3 (`chttpd_auth_lockout`, default threshold 5) answers the first five wrong
    /// passwords 401 and the next attempt, even with the right password, 403 with `LOCKOUT_MSG`
    /// (`couch_httpd_auth.erl`; `test/elixir/test/auth_lockout_test.exs` checks the same reason).
    #[tokio::test]
    async fn repeated_failures_lock_the_name_from_that_peer_only() {
        let auth = two_logins();
        let (status, body) = fixture_response(AUTH_WRONG_PASSWORD);
        for attempt in 0..5 {
            let err = auth.identify_from(&basic("alice", "guess"), peer(1)).await.unwrap_err();
            assert_eq!((err.status, err.body()), (status, body.clone()), "attempt {attempt}");
        }
        for password in ["guess", "alice-pw"] {
            let err = auth.identify_from(&basic("alice", password), peer(1)).await.unwrap_err();
            assert_eq!(err.status, StatusCode::FORBIDDEN, "{password}");
            assert_eq!(
                err.body(),
                serde_json::json!({
                    "error": "forbidden",
                    "reason": "Account is temporarily locked due to multiple authentication failures"
                })
            );
        }
        let runs = auth.password_verifications();
        auth.identify_from(&basic("alice", "guess"), peer(1)).await.unwrap_err();
        assert_eq!(auth.password_verifications(), runs, "a locked pair runs no hash");
        // Another login from the same peer, and the same login from another peer, still work.
        assert_eq!(
            auth.identify_from(&basic("admin", "admin-pw"), peer(1)).await.unwrap().principal,
            Some(Principal::Admin)
        );
        let alice = auth.identify_from(&basic("alice", "alice-pw"), peer(2)).await.unwrap();
        assert_eq!(alice.principal, Some(Principal::User("user_123".into())));
        // `POST /_session` counts and is refused the same way.
        let err = auth.log_in("alice", "alice-pw", peer(1), unix_now()).await.err().unwrap();
        assert_eq!((err.status, err.reason.as_str()), (StatusCode::FORBIDDEN, LOCKED_OUT));
        for _ in 0..5 {
            assert!(auth.log_in("admin", "nope", peer(3), unix_now()).await.unwrap().is_none());
        }
        let err = auth.log_in("admin", "admin-pw", peer(3), unix_now()).await.err().unwrap();
        assert_eq!(err.status, StatusCode::FORBIDDEN);
    }

    /// A backend whose local documents can be made unreachable, counting their reads.
    struct FlakyLocals {
        inner: Arc<dyn crate::backend::DocumentBackend>,
        down: std::sync::atomic::AtomicBool,
        local_reads: AtomicUsize,
    }

    #[async_trait::async_trait]
    impl crate::backend::raw::layer::Layered for FlakyLocals {
        fn inner(&self) -> &dyn crate::backend::DocumentBackend {
            self.inner.as_ref()
        }

        async fn get_local(&self, name: &str) -> Result<Option<crate::backend::StoredDocument>> {
            self.local_reads.fetch_add(1, Ordering::SeqCst);
            if self.down.load(Ordering::SeqCst) {
                return Err(Error::new(ErrorKind::Unavailable, "the backend is down"));
            }
            self.inner.get_local(name).await
        }

        async fn put_local(
            &self,
            name: &str,
            body: &serde_json::Map<String, serde_json::Value>,
            precondition: crate::backend::Precondition,
        ) -> Result<crate::backend::Revision> {
            if self.down.load(Ordering::SeqCst) {
                return Err(Error::new(ErrorKind::Unavailable, "the backend is down"));
            }
            self.inner.put_local(name, body, precondition).await
        }
    }

    async fn flaky_backend(dir: &tempfile::TempDir) -> Arc<FlakyLocals> {
        let embedded = crate::backend::embedded::EmbeddedBackend::open(&dir.path().join("s.redb")).await.unwrap();
        Arc::new(FlakyLocals {
            inner: Arc::new(embedded),
            down: std::sync::atomic::AtomicBool::new(false),
            local_reads: AtomicUsize::new(0),
        })
    }

    /// Two instances over one backend lock a pair at the threshold counted on both; once one
    /// knows the pair locked, it refuses it with no backend call and no hash.
    #[tokio::test]
    async fn failures_on_two_instances_add_up_and_a_known_lock_reads_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let backend = flaky_backend(&dir).await;
        let (a, b) = (two_logins(), two_logins());
        a.share_lockout(backend.clone());
        b.share_lockout(backend.clone());
        for attempt in 0..5 {
            let instance = if attempt % 2 == 0 { &a } else { &b };
            let err = instance.identify_from(&basic("alice", "guess"), peer(1)).await.unwrap_err();
            assert_eq!(err.status, StatusCode::UNAUTHORIZED, "attempt {attempt}");
        }
        let err = b.identify_from(&basic("alice", "alice-pw"), peer(1)).await.unwrap_err();
        assert_eq!((err.status, err.reason.as_str()), (StatusCode::FORBIDDEN, LOCKED_OUT));
        let (reads, runs) = (backend.local_reads.load(Ordering::SeqCst), b.password_verifications());
        let err = b.identify_from(&basic("alice", "alice-pw"), peer(1)).await.unwrap_err();
        assert_eq!(err.status, StatusCode::FORBIDDEN);
        assert_eq!(backend.local_reads.load(Ordering::SeqCst), reads, "a pair known locked reads no count");
        assert_eq!(b.password_verifications(), runs, "and runs no hash");
        // Another peer, and another name, are not locked.
        assert!(b.identify_from(&basic("alice", "alice-pw"), peer(2)).await.is_ok());
        assert!(a.identify_from(&basic("admin", "admin-pw"), peer(1)).await.is_ok());
    }

    /// With the backend down, logins that would work still work (no 5xx) and guesses are still
    /// locked out by this process's own count.
    #[tokio::test]
    async fn a_backend_failure_falls_back_to_this_process_count() {
        let dir = tempfile::tempdir().unwrap();
        let backend = flaky_backend(&dir).await;
        let auth = two_logins();
        auth.share_lockout(backend.clone());
        backend.down.store(true, Ordering::SeqCst);
        assert!(auth.identify_from(&basic("admin", "admin-pw"), peer(1)).await.is_ok());
        for attempt in 0..5 {
            let err = auth.identify_from(&basic("alice", "guess"), peer(1)).await.unwrap_err();
            assert_eq!(err.status, StatusCode::UNAUTHORIZED, "attempt {attempt}");
        }
        let err = auth.identify_from(&basic("alice", "alice-pw"), peer(1)).await.unwrap_err();
        assert_eq!((err.status, err.reason.as_str()), (StatusCode::FORBIDDEN, LOCKED_OUT));
    }

    #[test]
    fn a_lockout_ends_with_its_period() {
        let table = FailureTable::new(Duration::from_secs(300), 10);
        let start = Instant::now();
        for _ in 0..5 {
            table.record("k", start);
        }
        assert_eq!(table.count(&"k", start + Duration::from_secs(299)), 5);
        assert_eq!(table.count(&"k", start + Duration::from_secs(300)), 0);
        // A failure after the period starts a new count (the old entry is dropped first).
        table.record("k", start + Duration::from_secs(301));
        assert_eq!(table.count(&"k", start + Duration::from_secs(302)), 1);
    }

    /// A count read from the backend replaces a lower one here, with its start: the lockout ends
    /// on every instance when the shared period does. A higher count here is kept.
    #[test]
    fn a_shared_count_is_taken_with_its_period() {
        let table = FailureTable::new(Duration::from_secs(300), 10);
        let start = Instant::now();
        table.record("k", start + Duration::from_secs(100));
        table.raise_to("k", 5, start, start + Duration::from_secs(101));
        assert_eq!(table.count(&"k", start + Duration::from_secs(299)), 5);
        assert_eq!(table.count(&"k", start + Duration::from_secs(300)), 0, "the shared period is over");
        table.record("k", start + Duration::from_secs(301));
        table.record("k", start + Duration::from_secs(301));
        table.raise_to("k", 1, start + Duration::from_secs(250), start + Duration::from_secs(302));
        assert_eq!(table.count(&"k", start + Duration::from_secs(302)), 2);
        assert_eq!(table.len(), 1);
    }

    /// The table never holds more than its capacity: the oldest entries go first.
    #[test]
    fn the_failure_table_is_bounded_and_forgets_the_oldest() {
        let table = FailureTable::new(Duration::from_secs(300), 3);
        let now = Instant::now();
        for i in 0..1000u32 {
            table.record(i, now);
            assert!(table.len() <= 3, "{} entries", table.len());
        }
        assert_eq!(table.count(&0, now), 0, "the oldest is forgotten");
        assert_eq!(table.count(&999, now), 1);
        assert_eq!(table.count(&997, now), 1);
    }

    /// Guesses from a peer with recent failures take their own lane: one check at a time, a
    /// bounded waiting list, 429 at once past it; a login from elsewhere never waits there.
    #[tokio::test]
    async fn guesses_cannot_starve_other_logins() {
        let toml = format!(
            "couchdb_max_queued_suspect_logins = 1\n[[couchdb_users]]\nname = \"alice\"\npassword_hash = \"{}\"\nuser = \"u1\"\n",
            cheap_hash("alice-pw")
        );
        let auth = Arc::new(CouchAuth::from_settings(&settings(&toml).unwrap()).unwrap());
        let attacker = peer(66);
        // Guesses rotating names lock none of them, but make the address a suspect.
        for i in 0..5 {
            let err = auth.identify_from(&basic(&format!("name{i}"), "guess"), attacker).await.unwrap_err();
            assert_eq!(err.status, StatusCode::UNAUTHORIZED);
        }
        // The suspect lane is busy (as with a slow guess running).
        let busy = auth.suspect_slots.clone().acquire_owned().await.unwrap();
        let queued = tokio::spawn({
            let auth = Arc::clone(&auth);
            async move { auth.identify_from(&basic("alice", "guess2"), attacker).await }
        });
        while auth.suspect_waiting.load(Ordering::Acquire) == 0 {
            tokio::task::yield_now().await;
        }
        let refused = auth.identify_from(&basic("alice", "guess3"), attacker).await.unwrap_err();
        assert_eq!((refused.status, refused.error.as_str()), (StatusCode::TOO_MANY_REQUESTS, "too_many_requests"));
        assert!(refused.reason.contains("couchdb_max_queued_suspect_logins"), "{}", refused.reason);
        // Someone else's login runs in the main lane while the guesses wait.
        let other = auth.identify_from(&basic("alice", "alice-pw"), peer(7)).await.unwrap();
        assert_eq!(other.principal, Some(Principal::User("u1".into())));
        drop(busy);
        assert_eq!(queued.await.unwrap().unwrap_err().status, StatusCode::UNAUTHORIZED);
    }

    /// `_metrics` is the one reserved role a configured login may hold (CouchDB's `_users`
    /// admits it too): it reads the node's statistics.
    #[tokio::test]
    async fn a_configured_login_may_hold_the_metrics_role() {
        let toml = format!(
            "[[couchdb_users]]\nname = \"scraper\"\npassword_hash = \"{}\"\nroles = [\"_metrics\"]\n",
            cheap_hash("scraper-pw")
        );
        let auth = CouchAuth::from_settings(&settings(&toml).unwrap()).unwrap();
        let scraper = auth.identify(&basic("scraper", "scraper-pw")).await.unwrap();
        assert_eq!((scraper.roles, scraper.principal), (vec!["_metrics".to_owned()], None));
    }

    #[test]
    fn configuration_errors_name_the_field() {
        let hash = cheap_hash("pw");
        let login = |name: &str, password_hash: &str, scope: &str| {
            format!("[[couchdb_users]]\nname = \"{name}\"\npassword_hash = \"{password_hash}\"\n{scope}\n")
        };
        let fails = |toml: String| match settings(&toml).and_then(|s| CouchAuth::from_settings(&s)) {
            Ok(_) => panic!("accepted:\n{toml}"),
            Err(err) => err.to_string(),
        };
        let pbkdf2 = "$pbkdf2-sha256$i=600000$c2FsdHNhbHQ$aGFzaGhhc2hoYXNoaGFzaGhhc2hoYXNoaGFzaGhhc2g";
        let cases = [
            (login("a", "secret", "admin = true"), "invalid couchdb_users[0].password_hash: is not a PHC string"),
            (login("a", pbkdf2, "admin = true"), "invalid couchdb_users[0].password_hash: uses \"pbkdf2-sha256\""),
            (login("a", &hash, "admin = true\nuser = \"u\""), "invalid couchdb_users[0]: takes at most one of"),
            (
                login("a", &hash, "roles = [\"_admin\"]"),
                "invalid couchdb_users[0].roles[0]: must be non-empty, not start with `_`",
            ),
            (login("a", &hash, "user = \"u\"\nroles = [\"ok\", \"_reader\"]"), "invalid couchdb_users[0].roles[1]"),
            (login("a", &hash, "roles = [\"\"]"), "invalid couchdb_users[0].roles[0]"),
            (login("a:b", &hash, "admin = true"), "invalid couchdb_users[0].name: must be non-empty"),
            (login("", &hash, "admin = true"), "invalid couchdb_users[0].name"),
            (login("a", &hash, "user = \"u:1\""), "invalid couchdb_users[0].user"),
            (
                login("a", &hash, "admin = true") + &login("a", &hash, "user = \"u\""),
                "invalid couchdb_users[1].name: \"a\" is configured twice",
            ),
            ("couchdb_session_secret = \"abcd\"".into(), "invalid couchdb_session_secret: must be at least 32 hex"),
            (format!("couchdb_session_secret = \"{}\"", "zz".repeat(16)), "invalid couchdb_session_secret"),
            ("couchdb_session_timeout_secs = 0".into(), "invalid couchdb_session_timeout_secs: must be from 1"),
            ("couchdb_users = \"alice-no-scope\"".into(), "invalid couchdb_users[0]: entries must be NAME:SCOPE:PHC"),
            (format!("couchdb_users = \"a::{hash}:ok,_admin\""), "invalid couchdb_users[0].roles[1]"),
        ];
        for (toml, expected) in cases {
            let message = fails(toml.clone());
            assert!(message.starts_with(expected), "{toml}\n=> {message}\nexpected: {expected}");
        }
    }

    #[tokio::test]
    async fn the_compact_form_of_couchdb_users_is_read() {
        let compact = format!(
            "admin:*:{} ;\n alice:user_123:{}; carol::{}:readers,editors",
            cheap_hash("admin-pw"),
            cheap_hash("alice-pw"),
            cheap_hash("carol-pw")
        );
        let toml = format!("couchdb_users = \"{}\"", compact.replace('\n', "\\n"));
        let auth = CouchAuth::from_settings(&settings(&toml).unwrap()).unwrap();
        assert_eq!(auth.authenticate(&basic("admin", "admin-pw")).await.unwrap(), Some(Principal::Admin));
        let alice = auth.authenticate(&basic("alice", "alice-pw")).await.unwrap();
        assert_eq!(alice, Some(Principal::User("user_123".into())));
        // An empty scope: no data-store user; the fourth part: roles.
        let carol = auth.identify(&basic("carol", "carol-pw")).await.unwrap();
        assert_eq!((carol.principal, carol.roles), (None, vec!["readers".to_owned(), "editors".to_owned()]));
    }

    /// A login may carry roles, and may be neither admin nor a data-store user: then it has no
    /// principal, the data-store routes refuse it with 403 (not 401: it did log in), and other
    /// databases see its name and roles. `_session` reports `_admin` first, then the roles.
    #[tokio::test]
    async fn logins_carry_roles_and_may_have_no_data_store_user() {
        let toml = format!(
            "[[couchdb_users]]\nname = \"root\"\npassword_hash = \"{}\"\nadmin = true\nroles = [\"ops\"]\n\
             [[couchdb_users]]\nname = \"alice\"\npassword_hash = \"{}\"\nuser = \"u1\"\nroles = [\"readers\"]\n\
             [[couchdb_users]]\nname = \"carol\"\npassword_hash = \"{}\"\nroles = [\"readers\", \"editors\"]\n\
             [[couchdb_users]]\nname = \"dave\"\npassword_hash = \"{}\"\n",
            cheap_hash("pw"),
            cheap_hash("pw"),
            cheap_hash("pw"),
            cheap_hash("pw")
        );
        let auth = CouchAuth::from_settings(&settings(&toml).unwrap()).unwrap();
        let root = auth.identify(&basic("root", "pw")).await.unwrap();
        assert_eq!(root.session_roles(), vec!["_admin", "ops"]);
        assert!(root.is_server_admin() && root.user_ctx().server_admin);
        let alice = auth.identify(&basic("alice", "pw")).await.unwrap();
        assert_eq!(alice.require().unwrap(), &Principal::User("u1".into()));
        assert_eq!(alice.session_roles(), vec!["readers"]);
        assert!(!alice.is_server_admin());
        let carol = auth.identify(&basic("carol", "pw")).await.unwrap();
        assert_eq!(carol.principal, None);
        assert_eq!(carol.session_roles(), vec!["readers", "editors"]);
        let refused = carol.require().unwrap_err();
        assert_eq!((refused.status, refused.reason.as_str()), (StatusCode::FORBIDDEN, NO_DATA_STORE_USER));
        assert!(carol.require_login().is_ok());
        let ctx = carol.user_ctx();
        assert_eq!(
            (ctx.name, ctx.roles, ctx.server_admin),
            (Some("carol"), &["readers".to_owned(), "editors".to_owned()][..], false)
        );
        let dave = auth.identify(&basic("dave", "pw")).await.unwrap();
        assert_eq!((dave.principal.clone(), dave.roles.len()), (None, 0));
        assert_eq!(dave.require().unwrap_err().status, StatusCode::FORBIDDEN);
        let anonymous = auth.identify(&HeaderMap::new()).await.unwrap();
        assert_eq!(anonymous.require_login().unwrap_err().status, StatusCode::UNAUTHORIZED);
        assert_eq!(anonymous.require().unwrap_err().status, StatusCode::UNAUTHORIZED);
        // `POST /_session` reports the same roles.
        let (roles, _) = auth.log_in("carol", "pw", None, unix_now()).await.unwrap().unwrap();
        assert_eq!(roles, vec!["readers", "editors"]);
        let (roles, _) = auth.log_in("root", "pw", None, unix_now()).await.unwrap().unwrap();
        assert_eq!(roles, vec!["_admin", "ops"]);
    }

    #[test]
    fn hash_password_makes_an_argon2id_phc_string_that_verifies() {
        let phc = hash_password("correct horse").unwrap();
        assert!(phc.starts_with("$argon2id$v=19$m=19456,t=2,p=1$"), "{phc}");
        check_password_hash(&phc).unwrap();
        assert!(password_matches(&phc, "correct horse"));
        assert!(!password_matches(&phc, "correct horse "));
        assert_ne!(hash_password("correct horse").unwrap(), phc, "a fresh salt each time");
        assert!(hash_password("").unwrap_err().to_string().contains("password"));
    }

    #[test]
    fn cookies_are_read_from_any_cookie_header() {
        let mut headers = HeaderMap::new();
        headers.append(header::COOKIE, HeaderValue::from_static("theme=dark; AuthSession=abc"));
        assert_eq!(cookie_value(&headers, "AuthSession").as_deref(), Some("abc"));
        let mut headers = HeaderMap::new();
        headers.append(header::COOKIE, HeaderValue::from_static("a=1"));
        headers.append(header::COOKIE, HeaderValue::from_static("AuthSession=\"xyz\""));
        assert_eq!(cookie_value(&headers, "AuthSession").as_deref(), Some("xyz"));
        headers.insert(header::COOKIE, HeaderValue::from_static("AuthSession="));
        assert_eq!(cookie_value(&headers, "AuthSession"), None);
    }
}
