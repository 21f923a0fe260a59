//! Who a request acts for, and what that lets it see.
//!
//! An admin sees every document. A per-user login sees and writes only the documents whose
//! `userId` is its own. A data-store id starts with `{userId}:` and a user id never contains `:`,
//! so the id alone says whose a document is: listings and feeds filter by id prefix without
//! reading documents, and writes are checked against both the id and the `userId` field.

use super::error::CouchError;

/// The identity a request acts as.
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

    /// The CouchDB roles this principal reports (`userCtx.roles`).
    pub fn roles(&self) -> Vec<&'static str> {
        match self {
            Principal::Admin => vec!["_admin"],
            Principal::User(_) => Vec::new(),
        }
    }

    /// Whether the document with this id belongs to what the principal may see.
    pub fn may_access_id(&self, id: &str) -> bool {
        match self {
            Principal::Admin => true,
            Principal::User(user) => id.strip_prefix(user.as_str()).is_some_and(|rest| rest.starts_with(':')),
        }
    }

    /// The 403 for a document outside the principal's user.
    pub fn check_id(&self, id: &str) -> Result<(), CouchError> {
        if self.may_access_id(id) {
            Ok(())
        } else {
            Err(CouchError::forbidden(format!(
                "this login may only access documents of user {:?}",
                self.only_user().unwrap_or_default()
            )))
        }
    }

    /// The name a `_local/{name}` document is stored under: per-user logins get their own
    /// replication checkpoints, so one user cannot read or reset another's.
    pub fn local_name(&self, name: &str) -> String {
        match self {
            Principal::Admin => name.to_owned(),
            Principal::User(user) => format!("{user}:{name}"),
        }
    }

    /// The id range a per-user login's listings are confined to: `[user:, user;)`, since `;`
    /// is the byte after `:`.
    pub fn id_bounds(&self) -> Option<(String, String)> {
        self.only_user().map(|user| (format!("{user}:"), format!("{user};")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_sees_only_ids_that_start_with_its_user_and_a_colon() {
        let alice = Principal::User("alice".into());
        assert!(alice.may_access_id("alice:ns:a2V5"));
        assert!(!alice.may_access_id("alicia:ns:a2V5"));
        assert!(!alice.may_access_id("alice"));
        assert!(!alice.may_access_id("bob:ns:a2V5"));
        assert!(Principal::Admin.may_access_id("bob:ns:a2V5"));
        assert_eq!(alice.local_name("cp"), "alice:cp");
    }
}
