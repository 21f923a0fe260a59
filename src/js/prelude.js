// The host side of one design document's realm (src/js/worker.rs evaluates this once per
// compiled design document). It defines CouchDB's function API as globals of the realm (emit,
// sum, log, toJSON, isArray, require) and returns the host object the worker calls: documents
// and results cross as JSON text, parsed and written here with the realm's JSON, as couchjs does.
//
// The expression evaluates to a function taking the design document's JSON, the Rust log
// sink and the longest line it takes; the worker calls it and keeps the object it returns.
(function (ddocJson, hostLog, logLineLimit) {
  "use strict";
  var parse = JSON.parse;
  var stringify = JSON.stringify;
  var freeze = Object.freeze;
  var objectKeys = Object.keys;
  var isArrayValue = Array.isArray;
  var objectToString = Object.prototype.toString;
  var hasOwn = Object.prototype.hasOwnProperty;
  var global = globalThis;

  var ddoc = parse(ddocJson);
  // Compiled functions by path ("views.NAME.map", "filters.NAME", "validate_doc_update").
  var funs = {};
  // The map functions of the views the current map call asked for, in its order.
  var mapFuns = [];
  // What the function running now is: "map", "filter_view" (a view's map function used as a
  // `_changes` filter) or "ddoc" (validate_doc_update, filters). It decides what `emit` does and
  // which object `require` resolves from.
  var mode = "ddoc";
  var rows = null;
  var emitted = false;
  var filterReq = null;
  // Modules by id ("views/lib/util"). Map and reduce functions resolve from a root holding
  // only `views.lib`, the others from the whole design document; an id names the same source
  // under either root, so one cache serves both.
  var moduleCache = {};

  function isErrorLike(value) {
    return value !== null && typeof value === "object" &&
      "stack" in value && "name" in value && "message" in value;
  }

  // Error objects serialize as {} in JSON; CouchDB turns them into {error, message} wherever
  // a value leaves the function (emitted values, log lines).
  function errorToJson(value) {
    return isErrorLike(value) ? { error: value.name, message: value.message } : value;
  }

  // A thrown value as one line of text, for logs and error messages.
  function describe(thrown) {
    if (isErrorLike(thrown)) {
      return String(thrown.name) + ": " + String(thrown.message);
    }
    if (Array.isArray(thrown) && thrown.length === 3 &&
        (thrown[0] === "error" || thrown[0] === "fatal")) {
      return String(thrown[1]) + ": " + String(thrown[2]);
    }
    var text;
    try {
      text = stringify(thrown);
    } catch (ignored) {
      text = undefined;
    }
    return text === undefined ? String(thrown) : text;
  }

  // Errors that end the whole call instead of skipping one document, as in CouchDB: the
  // engine's own InternalErrors (out of memory), a stack overflow (CouchDB's QuickJS raises it
  // as an InternalError), `throw "fatal_error"` and `throw ["fatal", …]`.
  function isFatal(thrown) {
    if (thrown === "fatal_error") return true;
    if (Array.isArray(thrown) && thrown[0] === "fatal") return true;
    if (thrown !== null && typeof thrown === "object") {
      if (thrown.name === "InternalError") return true;
      if (thrown.name === "RangeError" && thrown.message === "Maximum call stack size exceeded") {
        return true;
      }
    }
    return false;
  }

  function rethrowFatal(thrown) {
    if (thrown === "fatal_error") {
      throw ["error", "map_runtime_error", "function raised 'fatal_error'"];
    }
    throw thrown;
  }

  // Freezes a document parsed from JSON and everything in it. A parsed tree holds only plain
  // objects, arrays and primitives, each reached once and none frozen yet: there is no cycle or
  // frozen part to look for, and an array's elements are read by index (listing its keys, as
  // for an object, would make a string of each index).
  function freezeParsed(value) {
    if (value === null || typeof value !== "object") return;
    if (isArrayValue(value)) {
      for (var i = 0; i < value.length; i++) freezeParsed(value[i]);
    } else {
      var keys = objectKeys(value);
      for (var k = 0; k < keys.length; k++) freezeParsed(value[keys[k]]);
    }
    freeze(value);
  }


  // CommonJS modules stored in the design document. A path is split on "/": its first
  // segment starts at the root unless it is "." (the requiring module's object) or ".." (that
  // object's parent); the value reached must be a string of JavaScript.
  function requireError(kind, message) {
    return ["error", kind, message];
  }

  function resolveModule(path, from, root) {
    var segments = String(path).split("/");
    var place = from;
    for (var i = 0; i < segments.length; i++) {
      var segment = segments[i];
      if (segment === "..") {
        if (!(place && place.parent && place.parent.parent)) {
          throw requireError("invalid_require_path",
            "require('" + path + "'): \"..\" goes above the design document");
        }
        place = {
          id: place.id.slice(0, place.id.lastIndexOf("/")),
          parent: place.parent.parent,
          current: place.parent.current
        };
      } else if (segment === ".") {
        if (!(place && place.parent)) {
          throw requireError("invalid_require_path",
            "require('" + path + "'): \".\" needs a requiring module");
        }
        place = { id: place.id, parent: place.parent, current: place.current };
      } else {
        if (i === 0) place = { id: "", parent: null, current: root };
        var container = place.current;
        if (container === null || typeof container !== "object" ||
            !hasOwn.call(container, segment) || container[segment] === undefined) {
          throw requireError("invalid_require_path",
            "require('" + path + "'): no \"" + segment + "\" in " +
            (place.id === "" ? "the design document" : place.id));
        }
        place = {
          id: place.id === "" ? segment : place.id + "/" + segment,
          parent: place,
          current: container[segment]
        };
      }
    }
    if (typeof place.current !== "string") {
      throw requireError("invalid_require_path",
        "require('" + path + "'): " + place.id + " is a " + typeof place.current +
        ", not a string of JavaScript");
    }
    return place;
  }

  function requireFrom(path, requirer) {
    var root = mode === "map" ? { views: { lib: ddoc.views && ddoc.views.lib } } : ddoc;
    var cache = moduleCache;
    var place = resolveModule(path, requirer ? requirer.parent : null, root);
    if (hasOwn.call(cache, place.id)) return cache[place.id];
    var module = { id: place.id, parent: place.parent, current: place.current, exports: {} };
    // Cached before it runs, so a circular require sees the exports so far instead of
    // recursing until the stack runs out.
    cache[place.id] = module.exports;
    try {
      var body = (0, eval)("(function (module, exports, require) {" + place.current + "\n})");
      body.call(global, module, module.exports, function (inner) {
        return requireFrom(inner, module);
      });
    } catch (thrown) {
      delete cache[place.id];
      if (isFatal(thrown)) throw thrown;
      throw requireError("compilation_error",
        "require('" + path + "') raised " + describe(thrown));
    }
    cache[place.id] = module.exports;
    return module.exports;
  }

  global.emit = function (key, value) {
    if (mode === "map") {
      rows[rows.length] = [key, errorToJson(value)];
    } else if (mode === "filter_view") {
      emitted = true;
    }
  };
  global.sum = function (values) {
    var total = 0;
    for (var i in values) total += values[i];
    return total;
  };
  // A line crosses to the host cut to its limit, with its whole length when cut, so a huge
  // message is never copied out of the engine (the host bounds lines and their rate).
  global.log = function (message) {
    if (typeof message !== "string") message = stringify(errorToJson(message));
    message = String(message);
    if (message.length > logLineLimit) {
      hostLog(message.slice(0, logLineLimit), message.length);
    } else {
      hostLog(message, null);
    }
  };
  global.toJSON = stringify;
  global.isArray = function (value) {
    return objectToString.call(value) === "[object Array]";
  };
  global.require = function (path) {
    return requireFrom(path, null);
  };

  return {
    define: function (path, fun) {
      funs[path] = fun;
    },
    has: function (path) {
      return hasOwn.call(funs, path);
    },
    useViews: function (paths) {
      mapFuns = [];
      for (var i = 0; i < paths.length; i++) mapFuns[i] = funs[paths[i]];
    },
    // One document through the chosen map functions: per view, its rows or the text of what
    // it threw (that view skips the document).
    mapDoc: function (docJson) {
      var doc = parse(docJson);
      freezeParsed(doc);
      var out = [];
      mode = "map";
      try {
        for (var i = 0; i < mapFuns.length; i++) {
          rows = [];
          try {
            mapFuns[i](doc);
            out[out.length] = rows;
          } catch (thrown) {
            if (isFatal(thrown)) rethrowFatal(thrown);
            var message = "function raised exception " + describe(thrown);
            if (doc && doc._id !== undefined) message += " with doc._id " + doc._id;
            out[out.length] = message;
          }
        }
      } finally {
        rows = null;
        mode = "ddoc";
      }
      return stringify(out);
    },
    // reduce(keys, values, rereduce); a function that throws reduces to null and is logged.
    reduce: function (path, inputJson, rereduce) {
      var input = parse(inputJson);
      var keys = null;
      var values = input;
      if (!rereduce) {
        keys = new Array(input.length);
        values = new Array(input.length);
        for (var i = 0; i < input.length; i++) {
          keys[i] = input[i][0];
          values[i] = input[i][1];
        }
      }
      mode = "map";
      rows = [];
      var result;
      try {
        result = funs[path](keys, values, rereduce);
      } catch (thrown) {
        if (isFatal(thrown)) rethrowFatal(thrown);
        global.log("function raised exception " + describe(thrown));
        result = null;
      } finally {
        rows = null;
        mode = "ddoc";
      }
      var text = stringify([result]);
      return text;
    },
    // validate_doc_update(newDoc, oldDoc, userCtx, secObj) with the design document as `this`:
    // {"ok": true} or {"rejected": what it threw}. Error objects are not rejections: they
    // propagate (CouchDB answers them as its query server's errors).
    validate: function (argsJson) {
      var args = parse(argsJson);
      mode = "ddoc";
      try {
        funs.validate_doc_update.apply(ddoc, args);
      } catch (thrown) {
        if (isErrorLike(thrown) || isFatal(thrown)) throw thrown;
        return stringify({ rejected: thrown === undefined ? null : thrown });
      }
      return '{"ok":true}';
    },
    setFilterRequest: function (reqJson) {
      filterReq = parse(reqJson);
    },
    filterDoc: function (path, docJson) {
      mode = "ddoc";
      return (funs[path].call(ddoc, parse(docJson), filterReq) && true) || false;
    },
    // A view's map function as a filter: does it emit anything for the document?
    filterViewDoc: function (path, docJson) {
      mode = "filter_view";
      emitted = false;
      try {
        funs[path](parse(docJson));
      } finally {
        mode = "ddoc";
      }
      return emitted;
    }
  };
})
