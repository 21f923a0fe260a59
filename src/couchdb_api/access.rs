//! Who a request acts for, and what that lets it see.
//!
//! On the data-store database a request acts as a [`Principal`]. An admin sees every document. A
//! per-user login sees and writes only the documents whose `userId` is its own. What that admits
//! (ids, local names, listings' id ranges) is the data-store rules' [`Confinement`]
//! ([`Principal::confinement`]), below HTTP, so the engine applies the same rule.
//!
//! On every other database what counts is the login's name and roles against the database's
//! `_security` object, as CouchDB 3.4 decides it ([`db_access`]): server admins may do
//! everything, the database's admins (by name or role) also change `_security`, `_revs_limit` and
//! design documents, its members (by name or role) read and write the other documents.
//!
//! Why two notions and not a third `Principal`: `Principal` is the data-store scope, matched in
//! every data-store handler, where `only_user() == None` means "sees everything". A login with
//! no data-store user (roles only) has no such scope, so it has no `Principal` at all
//! ([`super::auth::Identity::principal`] is `None`) and the data-store routes refuse it before
//! any handler runs; nothing there can mistake it for an admin. Its name and roles travel in the
//! request's `Identity` beside the scope.

use serde_json::Value;

use super::error::CouchError;
use crate::database::data_store_rules::Confinement;

/// Whom a request acts as on the data-store database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// Sees and writes everything (CouchDB's `_admin` role).
    Admin,
    /// Sees and writes only the documents of this data-store user id.
    User(String),
}

impl Principal {
    /// The user a per-user login is confined to; `None` for an admin.
    pub fn only_user(&self) -> Option<&str> {
        match self {
            Principal::Admin => None,
            Principal::User(user) => Some(user),
        }
    }

    /// What the principal may see and write, as the data-store rules decide it
    /// ([`crate::database::data_store_rules::Confinement`]: which ids, which local names, which
    /// id range a listing is clipped to).
    pub fn confinement(&self) -> Confinement {
        match self {
            Principal::Admin => Confinement::Everything,
            Principal::User(user) => Confinement::User(user.clone()),
        }
    }
}

/// CouchDB's reason for a login that is not a database admin (`couch_db:check_is_admin`): 403 for
/// a named login, on `PUT /{db}/_security`, `PUT /{db}/_revs_limit` and design document writes.
pub const NOT_DB_ADMIN: &str = "You are not a db or server admin.";
/// CouchDB's reason for a login that is neither a member nor an admin (403).
pub const NOT_ALLOWED_IN_DB: &str = "You are not allowed to access this db.";

/// What a login may do on a database other than the data-store one, from least to most.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum DbAccess {
    /// Named in `members`: reads, and writes every document but design documents.
    Member,
    /// Named in `admins`: also design documents, `_security`, `_revs_limit`, compaction.
    DbAdmin,
    /// A server admin: everything, `_purge` and creating or deleting databases too.
    ServerAdmin,
}

/// A login as a database's `_security` sees it (CouchDB's `userCtx`).
#[derive(Debug, Clone, Copy)]
pub struct UserCtx<'a> {
    /// The login name; `None` for an anonymous request.
    pub name: Option<&'a str>,
    /// The login's configured roles (never `_`-roles: those are refused at configuration).
    pub roles: &'a [String],
    pub server_admin: bool,
}

/// What `_security` lets this login do, or `None` when it may not use the database at all.
///
/// As CouchDB 3.4's `couch_db` decides it: a login is a database admin when `admins.names` holds
/// its name or `admins.roles` shares one of its roles, a member likewise by `members`; database
/// admins are members too. One difference, kept on purpose: a `_security` without members
/// (`members.names` and `members.roles` both empty or absent) admits only admins here, where
/// CouchDB would make such a database public. CouchDB 3 creates every database with
/// `members.roles = ["_admin"]` (`default_security = admin_only`), so a database is public there
/// only after an admin empties its members; here a database starts with an empty `_security`, and
/// it stays admin-only until members are named.
pub fn db_access(security: &Value, who: UserCtx<'_>) -> Option<DbAccess> {
    if who.server_admin {
        return Some(DbAccess::ServerAdmin);
    }
    let strings = |group: &str, list: &str| -> Vec<&str> {
        security
            .get(group)
            .and_then(|g| g.get(list))
            .and_then(Value::as_array)
            .map(|items| items.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default()
    };
    let named_in = |group: &str| {
        who.name.is_some_and(|name| strings(group, "names").contains(&name))
            || strings(group, "roles").iter().any(|role| who.roles.iter().any(|mine| mine == role))
    };
    if named_in("admins") {
        Some(DbAccess::DbAdmin)
    } else if named_in("members") {
        Some(DbAccess::Member)
    } else {
        None
    }
}

/// CouchDB's refusal of a login `_security` does not admit: 401 without credentials, 403 with.
pub fn not_admitted(who: UserCtx<'_>) -> CouchError {
    match who.name {
        None => CouchError::unauthorized(super::auth::NOT_AUTHORIZED_FOR_DB),
        Some(_) => CouchError::forbidden(NOT_ALLOWED_IN_DB),
    }
}

impl DbAccess {
    /// `PUT /{db}/_security`, `PUT /{db}/_revs_limit`, design document writes: CouchDB's 403.
    pub fn require_db_admin(self) -> Result<(), CouchError> {
        if self >= DbAccess::DbAdmin {
            Ok(())
        } else {
            Err(CouchError::forbidden(NOT_DB_ADMIN))
        }
    }

    /// `_compact` and `_view_cleanup`: CouchDB checks these before the database opens
    /// (`chttpd_auth_request:require_db_admin`) and answers 401 with its own wording.
    pub fn require_db_admin_to_compact(self) -> Result<(), CouchError> {
        if self >= DbAccess::DbAdmin {
            Ok(())
        } else {
            Err(CouchError::unauthorized("You are not a server or db admin."))
        }
    }

    /// `_purge`: server admins only (CouchDB's 401).
    pub fn require_server_admin(self) -> Result<(), CouchError> {
        if self == DbAccess::ServerAdmin {
            Ok(())
        } else {
            Err(CouchError::unauthorized("You are not a server admin."))
        }
    }

    /// A write of the document `id`: design documents need a database admin (CouchDB's
    /// `validate_doc_update` runs `check_is_admin` for `_design/` ids, replicated writes too).
    pub fn check_write(self, id: &str) -> Result<(), CouchError> {
        if id.starts_with("_design/") {
            self.require_db_admin()
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use serde_json::json;

    fn login<'a>(name: &'a str, roles: &'a [String]) -> UserCtx<'a> {
        UserCtx { name: Some(name), roles, server_admin: false }
    }

    /// Names and roles, in members and in admins, against CouchDB's rules; empty security and
    /// empty members admit only server admins.
    #[test]
    fn security_admits_by_name_or_role_as_couchdb_does() {
        let readers = vec!["readers".to_owned()];
        let editors = vec!["editors".to_owned(), "other".to_owned()];
        let none: Vec<String> = Vec::new();
        let reader = vec!["reader".to_owned()];
        let security = json!({
            "admins": { "names": ["ann"], "roles": ["editors"] },
            "members": { "names": ["mel"], "roles": ["readers"] }
        });
        let cases = [
            (login("ann", &none), Some(DbAccess::DbAdmin)),
            (login("someone", &editors), Some(DbAccess::DbAdmin)),
            (login("mel", &none), Some(DbAccess::Member)),
            (login("someone", &readers), Some(DbAccess::Member)),
            // An admin by name who is also a member by role is an admin.
            (login("ann", &readers), Some(DbAccess::DbAdmin)),
            (login("someone", &none), None),
            (login("readers", &none), None),
            (login("mel2", &reader), None),
            (UserCtx { name: None, roles: &none, server_admin: false }, None),
            (UserCtx { name: Some("root"), roles: &none, server_admin: true }, Some(DbAccess::ServerAdmin)),
        ];
        for (who, expected) in cases {
            assert_eq!(db_access(&security, who), expected, "{who:?}");
        }
        // Empty `_security`, or admins without members: admins only.
        let admins_only = json!({ "admins": { "names": ["ann"], "roles": ["editors"] }, "members": {} });
        for security in [json!({}), admins_only.clone(), json!({ "members": { "names": [], "roles": [] } })] {
            assert_eq!(db_access(&security, login("mel", &readers)), None, "{security}");
            assert_eq!(db_access(&security, login("x", &none)), None, "{security}");
        }
        assert_eq!(db_access(&admins_only, login("x", &editors)), Some(DbAccess::DbAdmin));
        assert_eq!(
            db_access(&json!({}), UserCtx { name: None, roles: &none, server_admin: true }),
            Some(DbAccess::ServerAdmin)
        );
        // Malformed lists name nobody.
        let odd = json!({ "members": { "names": "mel", "roles": [1, "readers"] } });
        assert_eq!(db_access(&odd, login("mel", &none)), None);
        assert_eq!(db_access(&odd, login("x", &readers)), Some(DbAccess::Member));
    }

    #[test]
    fn each_level_is_refused_with_couchdbs_status_and_reason() {
        let member = DbAccess::Member;
        let refused = member.require_db_admin().unwrap_err();
        assert_eq!(
            (refused.status, refused.error.as_str(), refused.reason.as_str()),
            (StatusCode::FORBIDDEN, "forbidden", NOT_DB_ADMIN)
        );
        let refused = member.require_db_admin_to_compact().unwrap_err();
        assert_eq!(
            (refused.status, refused.reason.as_str()),
            (StatusCode::UNAUTHORIZED, "You are not a server or db admin.")
        );
        let refused = DbAccess::DbAdmin.require_server_admin().unwrap_err();
        assert_eq!(
            (refused.status, refused.reason.as_str()),
            (StatusCode::UNAUTHORIZED, "You are not a server admin.")
        );
        assert!(DbAccess::DbAdmin.require_db_admin().is_ok() && DbAccess::ServerAdmin.require_server_admin().is_ok());
        assert!(member.check_write("doc").is_ok() && member.check_write("_local/x").is_ok());
        assert_eq!(member.check_write("_design/app").unwrap_err().status, StatusCode::FORBIDDEN);
        assert!(DbAccess::DbAdmin.check_write("_design/app").is_ok());
        let none: Vec<String> = Vec::new();
        let anonymous = not_admitted(UserCtx { name: None, roles: &none, server_admin: false });
        assert_eq!((anonymous.status, anonymous.error.as_str()), (StatusCode::UNAUTHORIZED, "unauthorized"));
        let named = not_admitted(login("x", &none));
        assert_eq!((named.status, named.reason.as_str()), (StatusCode::FORBIDDEN, NOT_ALLOWED_IN_DB));
    }
}
